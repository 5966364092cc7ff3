"""Cutting one iteration's events into the lists of its directives (oracle/planner.py
`Planner._parts`): event rows grouped by trainer, and the sync groups split into sync_now and
sync_later with a row of slots per trainer. In numpy these took a second sort, a gather
and two transposing copies, about a seventh of the planner's time at T = 32 on
bench/planner.py's stream; here each is one pass."""

from __future__ import annotations

import numpy as np

from oracle.kernels.cache import inlined, kernel


@kernel
def rows_by_group(
    events: np.ndarray, by_key: np.ndarray, trainer_col: int, target_col: int, num_trainers: int
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `events` (int64 [n, w]) ordered by trainer, then (if `target_col` >= 0)
    by target, then in the order `by_key` lists them (a stable order by key), and where each
    trainer's rows start (int64 [T + 1]). A counting sort over the small group numbers:
    stable, so rows of one group keep `by_key`'s order."""
    n, width = events.shape
    first, span = 0, 1
    if target_col >= 0 and n:
        first, last = events[0, target_col], events[0, target_col]
        for i in range(n):
            first = min(first, events[i, target_col])
            last = max(last, events[i, target_col])
        span = last - first + 1
    fill = np.zeros(num_trainers * span + 1, np.int64)
    for i in range(n):
        fill[_group(events, i, trainer_col, target_col, first, span) + 1] += 1
    for g in range(num_trainers * span):
        fill[g + 1] += fill[g]
    starts = np.empty(num_trainers + 1, np.int64)
    for j in range(num_trainers + 1):
        starts[j] = fill[j * span]
    out = np.empty((n, width), np.int64)
    for r in range(n):
        i = by_key[r]
        g = _group(events, i, trainer_col, target_col, first, span)
        w = fill[g]
        fill[g] = w + 1
        for c in range(width):
            out[w, c] = events[i, c]
    return out, starts


@inlined
def _group(events: np.ndarray, i: int, trainer_col: int, target_col: int, first: int, span: int) -> int:
    """Row i's group: its trainer, or its trainer and target (`rows_by_group`)."""
    if target_col < 0:
        return events[i, trainer_col]
    return events[i, trainer_col] * span + events[i, target_col] - first


@kernel
def split_groups(slots: np.ndarray, now: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sync groups' slots (int32 [G, T]) as two lists, int32 [T, n] each: the groups
    where `now` is set, and the others, each in the order of the groups."""
    groups, trainers = slots.shape
    n = 0
    for g in range(groups):
        n += now[g]
    now_slots = np.empty((trainers, n), np.int32)
    later_slots = np.empty((trainers, groups - n), np.int32)
    a = b = 0
    for g in range(groups):
        if now[g]:
            for j in range(trainers):
                now_slots[j, a] = slots[g, j]
            a += 1
        else:
            for j in range(trainers):
                later_slots[j, b] = slots[g, j]
            b += 1
    return now_slots, later_slots
