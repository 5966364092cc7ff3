"""Stable, vectorised hashes: the same value gives the same row on every run and machine.

Python's ``hash()`` is salted per process, so nothing here uses it. Every hash is SplitMix64
(a 64-bit finaliser with full avalanche) over uint64 words, computed with numpy.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# Value ids of raw categorical values: 0..2**63-1 for present values, this for missing.
MISSING = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_LOW63 = np.uint64(0x7FFF_FFFF_FFFF_FFFF)
# Hex digit value of each byte, 255 for a byte that is not a hex digit.
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser of a uint64 array (wraps mod 2**64, as intended)."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, dtype=np.uint64) + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1] int64, data uint8) of a string/binary arrow array, slice-aware."""
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(1, np.uint8)
    return offsets.astype(np.int64), data


def parse_hex8(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Criteo categorical values: (value ids uint64 [n], bad bool [n]).

    A present value must be exactly 8 hex digits and becomes its integer value; a null
    (empty field) becomes `MISSING`; anything else is flagged bad (its id is meaningless).
    """
    offsets, data = _string_buffers(arr)
    starts, lengths = offsets[:-1], np.diff(offsets)
    idx = np.minimum(starts[:, None] + np.arange(8), len(data) - 1)
    nibbles = _HEX[data[idx]]  # [n, 8] uint8
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    bad = valid & ((lengths != 8) | (nibbles == 255).any(axis=1))
    # Two nibbles per byte, four bytes read as one big-endian uint32.
    packed = np.ascontiguousarray((nibbles[:, 0::2] << 4) | (nibbles[:, 1::2] & 15))
    ids = packed.view(">u4")[:, 0].astype(np.uint64)
    ids[~valid] = MISSING
    return ids, bad


def hash_strings(arr: pa.Array) -> np.ndarray:
    """Value ids (uint64 [n], top bit clear) of arbitrary strings; nulls become `MISSING`.

    The bytes are packed into little-endian uint64 words (zero-padded) and folded with
    SplitMix64 together with the length, so "a" and "a\\0" differ. Vectorised over strings:
    one numpy pass per 8 bytes of the longest string in the chunk.
    """
    offsets, data = _string_buffers(arr)
    starts, lengths = offsets[:-1], np.diff(offsets)
    width = max(8, int(-(-lengths.max(initial=0) // 8) * 8))
    pos = np.arange(width)
    idx = np.minimum(starts[:, None] + pos, len(data) - 1)
    padded = np.where(pos < lengths[:, None], data[idx], 0).astype(np.uint8)
    words = np.ascontiguousarray(padded).view("<u8")  # [n, width // 8]
    h = mix64(lengths.astype(np.uint64))
    for k in range(words.shape[1]):
        h = mix64(h ^ words[:, k])
    h &= _LOW63
    h[~arr.is_valid().to_numpy(zero_copy_only=False)] = MISSING
    return h


def hash_rows(ids: np.ndarray, table: int, size: int) -> np.ndarray:
    """Rows of value ids in a hashed table of `size` rows: missing → 0, others in [1, size).

    The table index salts the hash so equal raw values in two tables are independent.
    """
    ids = np.asarray(ids, dtype=np.uint64)
    if size < 2:
        return np.zeros(len(ids), dtype=np.int64)
    salt = np.uint64(hash_salt(table))
    rows = (mix64(ids ^ salt) % np.uint64(size - 1)).astype(np.int64) + 1
    rows[ids == MISSING] = 0
    return rows


def hash_salt(table: int) -> int:
    """The salt of table `table`'s hash: equal raw values in two tables are independent."""
    return int(mix64(np.array([table + 1], dtype=np.uint64))[0])


def direct_rows(ids: np.ndarray, size: int) -> np.ndarray:
    """Rows of small integer values used as they are (value v → row v + 1, missing → 0)."""
    ids = np.asarray(ids, dtype=np.uint64)
    rows = np.zeros(len(ids), dtype=np.int64)
    present = ids != MISSING
    rows[present] = ids[present].astype(np.int64) + 1
    if rows.size and rows.max() >= size:
        raise ValueError(f"value {int(rows.max()) - 1} does not fit a direct table of {size} rows")
    return rows
