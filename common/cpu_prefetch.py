"""LLVM's prefetch instruction for numba (`prefetch_line`, `prefetch_row`): planning is bound
by memory latency, so the per-key loops start loading the rows of the keys a few steps
ahead, each the cache lines of a row that it will read."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_LINE = 64  # bytes


@intrinsic
def prefetch_line(
    typingctx: Any, array: types.Array, row: types.Integer, line: types.Integer
) -> tuple[Any, Any]:
    """Start loading the `line`-th cache line of `array[row]` (clamped to the row's last
    byte) into the cache, so that the loop that reaches it a few keys later does not wait on
    memory (planning is bound by that wait). numba has no prefetch of its own: this is
    LLVM's (`llvm.prefetch`, LLVM 15+)."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: tuple) -> Any:
        which = context.cast(builder, args[2], signature.args[2], types.intp)
        _prefetch(context, builder, signature, args, which)
        return context.get_dummy_value()

    return types.void(array, row, line), codegen


@intrinsic
def prefetch_row(typingctx: Any, array: types.Array, row: types.Integer) -> tuple[Any, Any]:
    """Start loading the first cache line of `array[row]` (`prefetch_line`)."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: tuple) -> Any:
        _prefetch(context, builder, signature, args, context.get_constant(types.intp, 0))
        return context.get_dummy_value()

    return types.void(array, row), codegen


def _prefetch(
    context: Any, builder: ir.IRBuilder, signature: Any, args: tuple, line: ir.Value
) -> None:
    rows = context.make_array(signature.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], signature.args[1], types.intp)
    stride = builder.extract_value(rows.strides, 0)
    offset = builder.mul(line, ir.Constant(stride.type, _LINE))
    last = builder.sub(stride, ir.Constant(stride.type, 1))
    offset = builder.select(builder.icmp_signed("<", offset, last), offset, last)
    byte = ir.IntType(8).as_pointer()
    data = builder.bitcast(rows.data, byte)
    start = cgutils.pointer_add(builder, data, builder.mul(index, stride))
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
        "llvm.prefetch.p0",
    )
    # for writing (the loops update the rows), keep in all levels, data cache
    address = cgutils.pointer_add(builder, start, offset)
    builder.call(fn, [address, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
