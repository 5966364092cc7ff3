"""The trainer's numba kernels: its host-side loops that numpy would run as many passes.

* `rowwise_adagrad_at`: one row-wise Adagrad step over rows of a CPU cache, fused.
  `RowWiseAdagrad.step_at` in torch ops is some fourteen passes over the rows it updates:
  gather the rows and their state, square, add the columns pairwise, divide, accumulate,
  take the root, add eps, update, scatter both back, and before them the gather of each
  row's gradient and its division by T. Each is a dispatch and a pass over memory, and on
  the CPU they were the training thread's largest cost outside forward and backward. This
  kernel does the same arithmetic in one pass, row by row, in the same order and in
  float32, so the two give the same bits (tests/trainer/test_optim.py holds them to it on
  random rows of every width up to 70). The torch ops stay for tensors on a GPU
  (`trainer.optim`).
* `scatter_rows`, `gather_rows`: rows and their optimizer state written to, or copied out of,
  a CPU cache's slots in one pass each (`trainer.cache.EmbeddingCache`): torch's
  `index_copy_` takes some 15 µs a call before it copies and twice `index_select`'s time
  for the copy, and a cache's rows are two tensors; prefetched as the step is.
* `used_slots`: the slots an iteration reads, and each input's index among them
  (`trainer.boundary._UsedSlots`), on every device: the directive's bookkeeping is host work.
* `end_indices`, `in_ascending`: the rest of that bookkeeping's passes over the directive's
  lists (`trainer.boundary.Boundary`: the indices of the end of an iteration, and which
  written keys are in sync_later), one pass each where numpy took a dozen between them:
  `Boundary.plan` 240 rather than 320 us an iteration at T = 2 (bench/e2e.py's quick job).

numba costs about 0.4 s and 40 MB of a trainer's memory to import, which the trainers' zygote
pays once (launcher/zygote.py); the kernels are compiled for their signatures when this
module is imported, from the cache in the user's folder after the first time
(``trainer-kernels/<digest>``: `common.jit`, stamped with this file and the prefetch
intrinsic that `rowwise_adagrad_at` compiles in).
"""

from __future__ import annotations

from common.numba_cache import use_user_cache

use_user_cache()  # before numba is imported: it reads the cache folder once

from pathlib import Path

import numpy as np
from numba import types

from common.cpu_prefetch import prefetch_row
from common.jit import CPU_PREFETCH, KernelCache

KERNELS = KernelCache("trainer-kernels", lambda: [Path(__file__).resolve(), CPU_PREFETCH])
#: How many rows ahead `rowwise_adagrad_at` starts loading a row, its state and its gradient:
#: the rows of a cache are read in no order a CPU's own prefetcher follows, and on two busy
#: cores the step waited on memory for most of its time (103-118 ns a row with the cache
#: flushed, 54-56 with 4 or 8 rows ahead, 4,000 rows of 16 floats out of 131,072).
_AHEAD = 4


def _read_only(dtype: types.Type, ndim: int) -> types.Array:
    """A C-contiguous array type that also takes read-only arrays (a directive's, decoded
    from its wire buffer), where a signature string's would refuse them."""
    return types.Array(dtype, ndim, "C", readonly=True)


_ADAGRAD = [types.void(types.float32[:, ::1], types.float32[:, ::1], _read_only(types.int64, 1),
                       _read_only(types.float32, 2), _read_only(types.int64, 1), types.float32, types.float32,
                       types.float32)]


@KERNELS.compiled(_ADAGRAD, nogil=True)
def rowwise_adagrad_at(
    table: np.ndarray, state: np.ndarray, index: np.ndarray, grad: np.ndarray, positions: np.ndarray,
    divisor: np.float32, neg_lr: np.float32, eps: np.float32,
) -> None:
    """Row-wise Adagrad on ``table[index[i]]`` with ``g = grad[positions[i]] / divisor``
    (``grad[i] / divisor`` where `positions` is empty), in place; `index` unique.

    Per row, as `trainer.optim.RowWiseAdagrad` in torch: ``acc += mean_of_squares(g)`` (the
    squares added by a pairwise tree over the columns, the odd column out joining the first
    pair), then ``row += (neg_lr * g) / (sqrt(acc) + eps)``, every operation rounded to
    float32 and the root correctly rounded. Raises before updating anything if a slot is
    outside the table or a position outside the gradient."""
    n, d = index.shape[0], table.shape[1]
    gathered = positions.shape[0] > 0
    if d == 0 or grad.shape[1] != d or state.shape[0] != table.shape[0] or state.shape[1] != 1:
        raise ValueError("rowwise_adagrad_at: shapes do not match")
    if (positions.shape[0] if gathered else grad.shape[0]) != n:
        raise ValueError("rowwise_adagrad_at: one gradient row per slot")
    for i in range(n):
        if index[i] < 0 or index[i] >= table.shape[0]:
            raise IndexError("rowwise_adagrad_at: a slot is outside the table")
        if gathered and (positions[i] < 0 or positions[i] >= grad.shape[0]):
            raise IndexError("rowwise_adagrad_at: a position is outside the gradient")
    g = np.empty(d, np.float32)
    level = np.empty(d, np.float32)
    width_f = np.float32(d)
    for i in range(n):
        if i + _AHEAD < n:
            ahead = index[i + _AHEAD]
            prefetch_row(table, ahead)
            prefetch_row(state, ahead)
            prefetch_row(grad, positions[i + _AHEAD] if gathered else i + _AHEAD)
        s = index[i]
        p = positions[i] if gathered else i
        for k in range(d):
            g[k] = grad[p, k] / divisor
            level[k] = g[k] * g[k]
        width = d
        while width > 1:
            half = width // 2
            for k in range(half):
                level[k] = level[k] + level[half + k]
            if width % 2:
                level[0] = level[0] + level[2 * half]
            width = half
        acc = state[s, 0] + level[0] / width_f
        state[s, 0] = acc
        # float64's root of a float32, rounded to float32, is float32's correctly rounded root
        denom = np.float32(np.sqrt(np.float64(acc))) + eps
        for k in range(d):
            table[s, k] = table[s, k] + (neg_lr * g[k]) / denom


_SCATTER = [types.void(types.float32[:, ::1], types.float32[:, ::1], _read_only(index, 1), _read_only(types.float32, 2),
                       _read_only(types.float32, 2)) for index in (types.int32, types.int64)]
_GATHER = [types.void(types.float32[:, ::1], types.float32[:, ::1], _read_only(index, 1), types.float32[:, ::1],
                      types.float32[:, ::1]) for index in (types.int32, types.int64)]


@KERNELS.inlined
def _check_rows(table: np.ndarray, state: np.ndarray, slots: np.ndarray, rows: np.ndarray,
                row_state: np.ndarray) -> None:
    """ValueError unless `rows` and `row_state` have a row per slot and the widths of
    `table` and `state`; IndexError if a slot is outside the table."""
    n = slots.shape[0]
    if rows.shape[0] != n or row_state.shape[0] != n or rows.shape[1] != table.shape[1] \
            or row_state.shape[1] != state.shape[1] or state.shape[0] != table.shape[0]:
        raise ValueError("shapes do not match")
    for i in range(n):
        if slots[i] < 0 or slots[i] >= table.shape[0]:
            raise IndexError("a slot is outside the table")


@KERNELS.compiled(_SCATTER, nogil=True)
def scatter_rows(table: np.ndarray, state: np.ndarray, slots: np.ndarray, rows: np.ndarray, row_state: np.ndarray) -> None:
    """``table[slots[i]] = rows[i]`` and ``state[slots[i]] = row_state[i]``; checks every
    shape and slot before it writes (`_check_rows`). The loops are written out: numba's slice
    assignment, or a helper that takes the arrays (each call counts references to them), is
    three to five times slower for rows of 16 floats."""
    _check_rows(table, state, slots, rows, row_state)
    n, d, w = slots.shape[0], table.shape[1], state.shape[1]
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row(table, slots[i + _AHEAD])
            prefetch_row(state, slots[i + _AHEAD])
        s = slots[i]
        for k in range(d):
            table[s, k] = rows[i, k]
        for k in range(w):
            state[s, k] = row_state[i, k]


@KERNELS.compiled(_GATHER, nogil=True)
def gather_rows(table: np.ndarray, state: np.ndarray, slots: np.ndarray, rows: np.ndarray, row_state: np.ndarray) -> None:
    """``rows[i] = table[slots[i]]`` and ``row_state[i] = state[slots[i]]``, into the caller's
    arrays; checks every shape and slot before it writes (`_check_rows`)."""
    _check_rows(table, state, slots, rows, row_state)
    n, d, w = slots.shape[0], table.shape[1], state.shape[1]
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row(table, slots[i + _AHEAD])
            prefetch_row(state, slots[i + _AHEAD])
        s = slots[i]
        for k in range(d):
            rows[i, k] = table[s, k]
        for k in range(w):
            row_state[i, k] = state[s, k]


_USED = [types.Tuple((types.int64[::1], types.int64[::1], types.int64[::1]))(_read_only(types.int32, 1), types.int64)]


@KERNELS.compiled(_USED, nogil=True)
def used_slots(flat: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct slots of `flat` ascending, a table of ``size + 1`` entries giving each its
    index among them and -1 elsewhere (the last entry answers slot -1), and each input's
    index: `trainer.boundary._UsedSlots`. The caller makes `size` exceed every slot of
    `flat` and checks that none is negative. O(C + n) in three passes, without a branch on
    the data, where numpy takes a scatter, a comparison, a nonzero and a gather."""
    index = np.full(size + 1, -1, np.int64)
    for i in range(flat.shape[0]):
        index[flat[i]] = 0
    slots = np.empty(min(size, flat.shape[0]) + 1, np.int64)  # every write lands at or below the count
    n = 0
    for s in range(size):
        used = index[s] == 0
        slots[n] = s
        index[s] = n if used else -1
        n += used
    inverse = np.empty(flat.shape[0], np.int64)
    for i in range(flat.shape[0]):
        inverse[i] = index[flat[i]]
    return slots[:n], index, inverse


_ASCENDING = [types.boolean[::1](_read_only(types.int64, 1), _read_only(types.int64, 1))]


@KERNELS.compiled(_ASCENDING, nogil=True)
def in_ascending(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """``np.isin(values, pool)`` for two strictly ascending arrays (a directive's key lists),
    by one merge of the two: O(n + m), where a binary search per value is O(n log m) and
    several numpy passes (`common.arrays.in_sorted`). ValueError if either is not strictly
    ascending."""
    n, m = values.shape[0], pool.shape[0]
    for i in range(1, n):
        if values[i] <= values[i - 1]:
            raise ValueError("in_ascending: values not strictly ascending")
    for j in range(1, m):
        if pool[j] <= pool[j - 1]:
            raise ValueError("in_ascending: pool not strictly ascending")
    found = np.zeros(n, np.bool_)
    j = 0
    for i in range(n):
        while j < m and pool[j] < values[i]:
            j += 1
        if j == m:
            break
        found[i] = pool[j] == values[i]
    return found


_END = [types.Tuple((types.int64[::1], types.int64[::1], types.int64[::1], types.int32[::1], types.int64[::1],
                     types.int32[::1]))(
    _read_only(types.int64, 1), _read_only(types.int64, 1), _read_only(types.int32, 1), _read_only(types.int32, 1),
    _read_only(types.int32, 1))]


@KERNELS.compiled(_END, nogil=True)
def end_indices(
    index: np.ndarray, used: np.ndarray, now_slots: np.ndarray, later_slots: np.ndarray, leave_slots: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The indices of an iteration's end (`trainer.boundary.EndIndices`) from `used_slots`'s
    `used` slots and their `index` (by slot, its index among them, -1 elsewhere and at its
    last entry, which slot -1 reads): each sync_now and each sync_later slot's index among
    the used slots (-1: not used, or -1 itself); the used slots in neither list, as indices
    and as slots; and the sync_later entries that stay (slot >= 0 and not among
    `leave_slots`), as indices into the list and as slots. Every sync slot must be below
    ``index.shape[0] - 1`` (IndexError otherwise); a leave slot may be anywhere. One pass
    over each list, where numpy takes a dozen."""
    size, count = index.shape[0] - 1, used.shape[0]
    left = np.ones(count + 1, np.bool_)  # the last entry takes the slots not used
    lists = (now_slots, later_slots)
    positions = (np.empty(now_slots.shape[0], np.int64), np.empty(later_slots.shape[0], np.int64))
    for k in range(2):
        slots, out = lists[k], positions[k]
        for i in range(slots.shape[0]):
            s = slots[i]
            if s < -1 or s >= size:
                raise IndexError("end_indices: a sync slot is outside the table")
            p = index[s] if s >= 0 else -1
            out[i] = p
            left[p if p >= 0 else count] = False
    alone = np.empty(count, np.int64)
    n = 0
    for p in range(count):
        alone[n] = p
        n += left[p]
    alone_slots = np.empty(n, np.int32)
    for i in range(n):
        alone_slots[i] = used[alone[i]]
    leaving = np.zeros(size + 1, np.bool_)
    for i in range(leave_slots.shape[0]):
        s = leave_slots[i]
        if 0 <= s < size:  # a slot the table does not reach is no sync_later slot
            leaving[s] = True
    stay = np.empty(later_slots.shape[0], np.int64)
    m = 0
    for i in range(later_slots.shape[0]):
        s = later_slots[i]
        stay[m] = i
        m += s >= 0 and not leaving[s]
    stay_slots = np.empty(m, np.int32)
    for i in range(m):
        stay_slots[i] = later_slots[stay[i]]
    return positions[0], positions[1], alone[:n], alone_slots, stay[:m], stay_slots
