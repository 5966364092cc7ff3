"""The converter's numba kernels: the Criteo text parser and the row hash.

They sit in one file for numba's cache (kept in the user's folder: `common.numba_cache`),
and only conversion imports this module: numba costs about 0.4 s and 60 MB to import, and
its compiler another 0.5 s and 100 MB to load the kernels, which processes that only read
converted or in-place data never pay. The kernels are compiled for their signatures when
this module is imported (from numba's cache after the first time): conversion workers fork
from a server that has imported it, and start with the kernels loaded. Tests hold each
kernel to its specification: the parser to the rules of `common.data.raw` and a plain
per-field parser (tests/common/data/test_raw.py), the hash to `hashing.hash_rows`, bit for bit.
"""

from __future__ import annotations

from common.numba_cache import use_user_cache

use_user_cache()  # before numba is imported: it reads the cache folder once

import numba
import numpy as np

# What `parse_criteo` found wrong with a line (codes, with the field where they apply).
OK, FIELD_COUNT, BAD_VALUE, MISSING_LABEL = 0, 1, 2, 3
CRITEO_FIELDS = 40  # label, 13 integers, 26 hex values
_NL, _TAB, _CR, _MINUS, _ZERO = 10, 9, 13, 45, 48
_INT64_MAX = np.uint64(2**63 - 1)
_MISSING = np.uint64(0xFFFF_FFFF_FFFF_FFFF)  # hashing.MISSING, as a constant numba can fold
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_HEX = np.full(256, 255, dtype=np.uint8)  # hex digit value of each byte, 255 for others
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


@numba.njit(cache=True, nogil=True, inline="always")
def _fields(
    buf: np.ndarray, start: int, bounds: np.ndarray, row: int, labels: np.ndarray, ints: np.ndarray, ids: np.ndarray
) -> tuple[int, int, int, int]:
    """Fill `row` from the 40 fields of one line; (code, field, span) of its first bad field."""
    a, b = start, bounds[0]
    if b - a == 1 and (buf[a] == _ZERO or buf[a] == _ZERO + 1):
        labels[row] = buf[a] - _ZERO
    elif b == a:
        return MISSING_LABEL, 0, a, b
    else:
        return BAD_VALUE, 0, a, b
    for j in range(13):
        a, b = bounds[j] + 1, bounds[j + 1]
        if a == b:
            ints[row, j] = 0
            continue
        negative = buf[a] == _MINUS
        digits = b - a - negative
        if digits < 1 or digits > 19:
            return BAD_VALUE, 1 + j, a, b
        v = np.uint64(0)
        for q in range(a + negative, b):
            d = np.int64(buf[q]) - _ZERO
            if d < 0 or d > 9:
                return BAD_VALUE, 1 + j, a, b
            v = v * np.uint64(10) + np.uint64(d)
        if v > _INT64_MAX + np.uint64(negative):  # outside int64 (19 digits can be)
            return BAD_VALUE, 1 + j, a, b
        ints[row, j] = -np.int64(v - np.uint64(1)) - 1 if negative else np.int64(v)
    for j in range(26):
        a, b = bounds[13 + j] + 1, bounds[14 + j]
        if a == b:
            ids[row, j] = _MISSING
            continue
        if b - a != 8:
            return BAD_VALUE, 14 + j, a, b
        v = np.uint64(0)
        for q in range(a, b):
            d = _HEX[buf[q]]
            if d == 255:
                return BAD_VALUE, 14 + j, a, b
            v = (v << np.uint64(4)) | np.uint64(d)
        ids[row, j] = v
    return OK, 0, a, b


@numba.njit(cache=True, nogil=True, inline="always")
def _mix64(x: np.uint64) -> np.uint64:
    """`hashing.mix64` of one value (SplitMix64's finaliser, wrapping mod 2**64)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


_C = numba.types.Array
_PARSE = numba.types.UniTuple(numba.int64, 8)(
    _C(numba.uint8, 1, "C", readonly=True), numba.boolean, _C(numba.float32, 1, "C"), _C(numba.int64, 2, "C"),
    _C(numba.uint64, 2, "C"),
)  # the bytes come from np.frombuffer: read-only


@numba.njit(_PARSE, cache=True, nogil=True)
def parse_criteo(
    buf: np.ndarray, skip: bool, labels: np.ndarray, ints: np.ndarray, ids: np.ndarray
) -> tuple[int, int, int, int, int, int, int, int]:
    """Parse the whole lines of `buf` (uint8; the last one may lack its newline) into
    `labels` float32 [n], `ints` int64 [n, 13] (missing: 0) and `ids` uint64 [n, 26]
    (missing: MISSING), n >= lines in `buf`.

    The rules of `common.data.raw` (a line is label, 13 integers, 26 hex values, tab-
    separated; "\\r\\n" ends a line too; an empty line is a line whose label is missing).
    Returns (rows written, lines read, lines skipped, and the first bad line's index in
    `buf`, code, field, and the byte span to quote: the field's, or the line's for a wrong
    field count); the index is -1 when there is none. In fail mode (`skip` False) parsing
    stops at the first bad line; in skip mode bad lines are dropped and counted.
    """
    bounds = np.empty(CRITEO_FIELDS, dtype=np.int64)  # tab positions of the current line
    n = len(buf)
    pos = rows = lines = skipped = 0
    err_line, err_code, err_field, err_a, err_b = -1, OK, 0, 0, 0
    while pos < n:
        start = pos
        tabs = 0
        while pos < n and buf[pos] != _NL:
            if buf[pos] == _TAB:
                if tabs < CRITEO_FIELDS:
                    bounds[tabs] = pos
                tabs += 1
            pos += 1
        end = pos
        pos += 1  # past the newline
        if end > start and buf[end - 1] == _CR:
            end -= 1
        code, field, a, b = OK, 0, start, end
        if end == start:
            code = MISSING_LABEL
        elif tabs != CRITEO_FIELDS - 1:
            code, field = FIELD_COUNT, tabs + 1
        else:
            bounds[CRITEO_FIELDS - 1] = end
            code, field, a, b = _fields(buf, start, bounds, rows, labels, ints, ids)
        lines += 1
        if code == OK:
            rows += 1
            continue
        if err_line < 0:
            err_line, err_code, err_field, err_a, err_b = lines - 1, code, field, a, b
        if not skip:
            break
        skipped += 1
    return rows, lines, skipped, err_line, err_code, err_field, err_a, err_b


@numba.njit(["void(uint64[:, ::1], uint64[::1], uint64[::1], int32[:, ::1])",
             "void(uint64[:, ::1], uint64[::1], uint64[::1], int64[:, ::1])"], cache=True, nogil=True)
def hash_into(ids: np.ndarray, salts: np.ndarray, moduli: np.ndarray, out: np.ndarray) -> None:
    """`hashing.hash_rows` of every column t of `ids` (uint64 [n, F]) into `out` [n, F]:
    MISSING → row 0, a value → ``1 + mix64(value ^ salts[t]) % moduli[t]`` (moduli: the
    table's size - 1; 0 for a one-row table, whose rows are all 0)."""
    n, f = ids.shape
    for i in range(n):
        for t in range(f):
            v = ids[i, t]
            if v == _MISSING or moduli[t] == 0:
                out[i, t] = 0
            else:
                out[i, t] = _mix64(v ^ salts[t]) % moduli[t] + np.uint64(1)
