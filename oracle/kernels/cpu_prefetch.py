"""LLVM's prefetch instruction for numba (`prefetch_row`): planning is bound by memory
latency, so the per-key loops start loading the rows of the keys a few steps ahead."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def prefetch_row(typingctx: Any, array: types.Array, row: types.Integer) -> tuple[Any, Any]:
    """Start loading `array[row]` (its first cache line) into the cache, so that the loop
    that reaches it a few keys later does not wait on memory (planning is bound by that
    wait). numba has no prefetch of its own: this is LLVM's (`llvm.prefetch`, LLVM 15+)."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: tuple) -> Any:
        rows = context.make_array(signature.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        offset = builder.mul(index, builder.extract_value(rows.strides, 0))
        byte = ir.IntType(8).as_pointer()
        start = cgutils.pointer_add(builder, builder.bitcast(rows.data, byte), offset)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
            "llvm.prefetch.p0",
        )
        # for writing (the loops update the rows), keep in all levels, data cache
        builder.call(fn, [start, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, row), codegen
