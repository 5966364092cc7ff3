"""Binary wire format shared by every body that carries arrays.

A message is::

    u32 LE  header length H
    H bytes orjson header {"meta": {...}, "arrays": [[name, dtype, shape], ...]}
    padding to a multiple of 8
    each array's raw little-endian bytes, each padded to a multiple of 8

Decoding returns read-only `np.frombuffer` views into the body: no copy of the payload.
Only the fixed-size little-endian dtypes below travel, so a peer can never make us build an
object array or read past the body.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from common.errors import WireError, clipped, quoted

ALIGN = 8
_LEN = struct.Struct("<I")
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in ("<f4", "<f8", "<i4", "<i8", "<u8", "<i2", "|u1", "|i1")
}
_WIRE_DTYPES = frozenset(DTYPES.values())  # dtypes hash as they compare: "<f4" is float32 here
MAX_HEADER_BYTES = 1 << 20
#: Dimensions an array may have (numpy's own limit is 64; our messages use at most 2).
MAX_NDIM = 8
#: The bytes an array's shape may describe, its zero dimensions counted as 1: numpy refuses
#: a shape whose size times its item size does not fit in a signed 64-bit integer, even
#: when a zero dimension makes the array empty.
_MAX_SHAPE_BYTES = (1 << 63) - 1
#: Headers whose meta and array layout `decode` remembers, and the longest it remembers
#: (real ones are a few hundred bytes: a peer must not pin megabytes in the memo).
MEMO_HEADERS = 256
MEMO_HEADER_BYTES = 4096
_ZEROS = bytes(ALIGN)


def _pad(n: int) -> int:
    return -n % ALIGN


def encode_parts(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
    """The message as a list of buffers, so large arrays are not copied before sending."""
    sent = [(name, _as_sent(name, arr)) for name, arr in arrays.items()]
    layout = tuple((name, arr.dtype, arr.shape) for name, arr in sent)
    parts: list[bytes | memoryview] = [_head(orjson.dumps(dict(meta)), layout)]
    for _, arr in sent:
        parts.append(memoryview(arr.reshape(-1)).cast("B"))
        if pad := _pad(arr.nbytes):
            parts.append(_ZEROS[:pad])
    return parts


@functools.lru_cache(maxsize=MEMO_HEADERS)
def _head(meta: bytes, layout: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> bytes:
    """The length, header and padding before a body's arrays; remembered, since a sender
    repeats a few layouts (the same meta, arrays of the same shapes) over and over."""
    specs = orjson.dumps([[name, dtype.str, list(shape)] for name, dtype, shape in layout])
    header = b'{"meta":' + meta + b',"arrays":' + specs + b"}"
    return _LEN.pack(len(header)) + header + bytes(_pad(_LEN.size + len(header)))


def _as_sent(name: str, arr: np.ndarray) -> np.ndarray:
    """`arr` as it travels: C-contiguous, little-endian, of a dtype in DTYPES (no copy when
    it is already so, as arrays mostly are)."""
    arr = np.asarray(arr)
    if arr.dtype in _WIRE_DTYPES and arr.flags.c_contiguous:
        return arr
    dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    wire_dtype = DTYPES.get(dtype.str)
    if wire_dtype is None:
        raise WireError(f"array {quoted(name)}: dtype {arr.dtype} cannot travel", array=clipped(name))
    if arr.dtype == wire_dtype and arr.flags.c_contiguous:
        return arr
    return np.require(arr, dtype=wire_dtype, requirements="C")


def encode(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    return b"".join(encode_parts(meta, arrays or {}))


def decode(body: bytes | bytearray | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Split a message into its meta dict and zero-copy array views; raise WireError if malformed."""
    view = memoryview(body).cast("B")
    if len(view) < _LEN.size:
        raise WireError(f"body of {len(view)} bytes is shorter than the 4-byte header length")
    (hlen,) = _LEN.unpack_from(view, 0)
    if hlen > MAX_HEADER_BYTES or _LEN.size + hlen > len(view):
        raise WireError(f"header length {hlen} does not fit in a body of {len(view)} bytes")
    raw = bytes(view[_LEN.size : _LEN.size + hlen])
    meta, slots = _remembered_header(raw) if hlen <= MEMO_HEADER_BYTES else _header(raw)
    pos = _LEN.size + hlen
    pos += _pad(pos)
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape, count, nbytes in slots:
        if pos + nbytes > len(view):
            raise WireError(f"array {quoted(name)} runs past the end of the body", array=clipped(name))
        flat = np.frombuffer(view, dtype=dtype, count=count, offset=pos)
        arrays[name] = flat if len(shape) == 1 else flat.reshape(shape)
        pos += nbytes + _pad(nbytes)
    if pos != len(view):
        raise WireError(f"{len(view) - pos} unexpected bytes after the last array")
    return dict(meta), arrays


#: An array's place in a body: name, dtype, shape, element count and bytes.
_Slot = tuple[str, np.dtype, tuple[int, ...], int, int]


def peer_json(raw: bytes | bytearray | memoryview, what: str = "body") -> Any:
    """A peer's JSON, WireError if it is not JSON or an object in it names a key twice
    (where orjson would quietly keep the last: {"version": 3, "version": 9} is ambiguous).
    orjson parses it; the standard library then looks for repeats, only where orjson
    found fewer keys than the text could hold (a cheap count of its colons says so)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"{what} is not valid JSON: {exc}") from None  # "header is not valid JSON: ..."
    if _keys_in(value) < bytes(raw).count(b":"):  # a colon inside a string also counts
        json.loads(bytes(raw), object_pairs_hook=lambda pairs: _unique(pairs, what))
    return value


def _keys_in(value: Any) -> int:
    if isinstance(value, dict):
        return len(value) + sum(_keys_in(v) for v in value.values())
    if isinstance(value, list):
        return sum(_keys_in(v) for v in value)
    return 0


def _unique(pairs: list[tuple[str, Any]], what: str) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise WireError(f"{what} names the key {quoted(key)} twice", field=clipped(key))
        seen.add(key)
    return dict(pairs)


def _header(raw: bytes) -> tuple[dict[str, Any], tuple[_Slot, ...]]:
    """The meta and the array slots a header gives; WireError if it is malformed."""
    header = peer_json(raw, "header")
    if not isinstance(header, dict) or not isinstance(header.get("meta", {}), dict):
        raise WireError("header must be an object with an object 'meta'")
    slots = []
    for name, dtype, shape in _array_specs(header.get("arrays", [])):
        if any(slot[0] == name for slot in slots):  # a handful of arrays: no set needed
            raise WireError(f"array {quoted(name)} is declared twice", array=clipped(name))
        count = math.prod(shape)
        slots.append((name, dtype, shape, count, count * dtype.itemsize))
    return header.get("meta", {}), tuple(slots)


#: `_header`, remembered by the header's bytes: a peer's bodies mostly repeat a few headers
#: (the same meta, arrays of the same shapes), and reading one is most of decoding a small
#: body. `decode` hands out a copy of the meta dict, so the remembered one stays as read.
_remembered_header = functools.lru_cache(maxsize=MEMO_HEADERS)(_header)


def _array_specs(raw: Any) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    if not isinstance(raw, list):
        raise WireError("'arrays' must be a list")
    specs = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise WireError(f"array spec {quoted(item)} must be [name, dtype, shape]")
        name, dtype, shape = item
        if dtype not in DTYPES:
            raise WireError(f"array {quoted(name)}: dtype {quoted(dtype)} is not allowed", array=clipped(name))
        specs.append((name, DTYPES[dtype], _shape(name, shape, DTYPES[dtype])))
    return specs


def _shape(name: str, shape: Any, dtype: np.dtype) -> tuple[int, ...]:
    """`shape` if numpy can build an array of it; WireError naming the array otherwise.
    (Whether the body holds that many bytes is checked by `decode`.)"""
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(n) is int and n >= 0 for n in shape)):
        raise WireError(
            f"array {quoted(name)}: shape {quoted(shape)} is invalid (at most {MAX_NDIM} non-negative "
            "integers)", array=clipped(name),
        )
    size = math.prod(n or 1 for n in shape) if 0 in shape else math.prod(shape)  # 0 counts as 1
    if size * dtype.itemsize > _MAX_SHAPE_BYTES:
        raise WireError(f"array {quoted(name)}: shape {quoted(shape)} is too large", array=clipped(name))
    return tuple(shape)


def require(arrays: Mapping[str, np.ndarray], name: str, dtype: str, ndim: int) -> np.ndarray:
    """The named array, checked for dtype and rank; WireError naming it otherwise."""
    if name not in arrays:
        raise WireError(f"missing array {name!r}", array=name)
    arr = arrays[name]
    expected = DTYPES[dtype] if dtype in DTYPES else np.dtype(dtype)
    if arr.dtype != expected or arr.ndim != ndim:
        raise WireError(
            f"array {name!r} must be {ndim}-d {expected}, got {arr.ndim}-d {arr.dtype}",
            array=name,
        )
    return arr
