"""Every trainer's directive of one iteration as flat arrays (`IterationParts`): what a planner
assembles once per iteration, what the planners of key partitions merge (`merge`), and what
is cut into one `Directive` per trainer (`assemble`).

Per-trainer lists hold trainer j's rows at [at[j], at[j + 1]) in the directive's canonical
order: fetches by (target, key), leaves and writes by key. The lists every trainer shares
(joins, sync lists) hold their keys ascending and a row of slots per trainer (-1: none).
Key partitions share no key, so merging their parts is merging sorted lists, and cutting
the merged parts gives each trainer the directive one planner of every key would give if
it had planned each partition's keys in that partition's slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from common.directive import Directive
from oracle.kernels.merge import merge_runs
from oracle.stats import IterationStats


@dataclass(frozen=True, kw_only=True)
class IterationParts:
    """Iteration `iteration`'s directives (global numbers throughout)."""

    iteration: int
    checkpoint: bool
    #: int32 [B, F]: every input's slot. A key partition's parts carry instead the slots of
    #: its inputs only (`input_values`, int32) and where they are (`input_positions`, flat).
    input_slots: np.ndarray | None
    input_positions: np.ndarray | None
    input_values: np.ndarray | None
    fetch_keys: np.ndarray  # int64 [n]
    fetch_slots: np.ndarray  # int32 [n]
    fetch_min_versions: np.ndarray  # int64 [n]
    fetch_targets: np.ndarray  # int32 [n]
    fetch_at: np.ndarray  # int64 [T + 1]
    leave_keys: np.ndarray  # int64 [n]: the order of leave_slots (not sent)
    leave_slots: np.ndarray  # int32 [n]
    leave_at: np.ndarray
    write_keys: np.ndarray  # int64 [n]
    write_slots: np.ndarray  # int32 [n]
    write_flush: np.ndarray  # uint8 [n]
    write_at: np.ndarray
    join_keys: np.ndarray  # int64 [J]
    join_send: np.ndarray  # int32 [T, J]
    join_recv: np.ndarray  # int32 [T, J]
    now_keys: np.ndarray  # int64 [N]
    now_slots: np.ndarray  # int32 [T, N]
    later_keys: np.ndarray  # int64 [M]
    later_slots: np.ndarray  # int32 [T, M]
    stats: IterationStats

    @property
    def num_trainers(self) -> int:
        return self.fetch_at.size - 1

    def without_inputs(self) -> IterationParts:
        """The same parts without their input slots (sent apart: oracle/workers.py)."""
        return dataclasses.replace(self, input_slots=None, input_positions=None, input_values=None)


def assemble(parts: IterationParts) -> list[Directive]:
    """One Directive per trainer, cut from `parts` (whose input_slots must be whole); the
    arrays are views of the parts'."""
    assert parts.input_slots is not None
    t = parts.num_trainers
    per = parts.input_slots.shape[0] // t
    f, lv, wr = parts.fetch_at, parts.leave_at, parts.write_at
    return [
        Directive(
            iteration=parts.iteration,
            trainer=j,
            input_slots=parts.input_slots[j * per : (j + 1) * per],
            prefetch_keys=parts.fetch_keys[f[j] : f[j + 1]],
            prefetch_slots=parts.fetch_slots[f[j] : f[j + 1]],
            prefetch_min_versions=parts.fetch_min_versions[f[j] : f[j + 1]],
            prefetch_targets=parts.fetch_targets[f[j] : f[j + 1]],
            join_keys=parts.join_keys,
            join_send_slots=parts.join_send[j],
            join_recv_slots=parts.join_recv[j],
            sync_now_keys=parts.now_keys,
            sync_now_slots=parts.now_slots[j],
            sync_later_keys=parts.later_keys,
            sync_later_slots=parts.later_slots[j],
            leave_slots=parts.leave_slots[lv[j] : lv[j + 1]],
            write_keys=parts.write_keys[wr[j] : wr[j + 1]],
            write_slots=parts.write_slots[wr[j] : wr[j + 1]],
            write_flush=parts.write_flush[wr[j] : wr[j + 1]],
            checkpoint=parts.checkpoint,
        )
        for j in range(t)
    ]


def merge(parts: list[IterationParts], input_slots: np.ndarray) -> IterationParts:
    """The parts of key partitions of one iteration (in partition order, each with its slots
    already in its share of the cache) as the parts of the whole, with `input_slots` (int32
    [B, F], every input's slot, put together by the caller)."""
    first = parts[0]
    if any(p.iteration != first.iteration for p in parts):
        raise ValueError(f"parts of iterations {sorted({p.iteration for p in parts})} merged")
    fetch = _merge_lists(parts, "fetch", ("keys", "slots", "min_versions", "targets"), minor="targets")
    leave = _merge_lists(parts, "leave", ("keys", "slots"))
    write = _merge_lists(parts, "write", ("keys", "slots", "flush"))
    join_keys, (send, recv) = _merge_shared(parts, "join_keys", ("join_send", "join_recv"))
    now_keys, (now_slots,) = _merge_shared(parts, "now_keys", ("now_slots",))
    later_keys, (later_slots,) = _merge_shared(parts, "later_keys", ("later_slots",))
    return IterationParts(
        iteration=first.iteration,
        checkpoint=first.checkpoint,
        input_slots=input_slots,
        input_positions=None,
        input_values=None,
        **fetch,
        **leave,
        **write,
        join_keys=join_keys,
        join_send=send,
        join_recv=recv,
        now_keys=now_keys,
        now_slots=now_slots,
        later_keys=later_keys,
        later_slots=later_slots,
        stats=_merged_stats([p.stats for p in parts]),
    )


def _merge_lists(
    parts: list[IterationParts], name: str, columns: tuple[str, ...], minor: str | None = None
) -> dict[str, np.ndarray]:
    """A per-trainer list (`name`_*, `name`_at) of every part, merged trainer by trainer."""
    keys = [getattr(p, f"{name}_keys") for p in parts]
    sizes = np.array([k.size for k in keys])
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    bounds = np.stack([getattr(p, f"{name}_at") + s for p, s in zip(parts, starts, strict=True)])
    all_keys = np.concatenate(keys)
    by = np.concatenate([getattr(p, f"{name}_{minor}") for p in parts]) if minor else np.zeros(all_keys.size, np.int64)
    order = merge_runs(by.astype(np.int64, copy=False), all_keys, bounds)
    out = {f"{name}_{c}": np.concatenate([getattr(p, f"{name}_{c}") for p in parts])[order] for c in columns}
    out[f"{name}_at"] = bounds.sum(axis=0) - starts.sum()
    return out


def _merge_shared(
    parts: list[IterationParts], keys_name: str, slot_names: tuple[str, ...]
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """A list every trainer shares: its keys, merged, and each [T, n] slot table in their order."""
    keys = [getattr(p, keys_name) for p in parts]
    sizes = np.array([k.size for k in keys])
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    all_keys = np.concatenate(keys)
    order = merge_runs(np.zeros(all_keys.size, np.int64), all_keys, np.stack([bounds[:-1], bounds[1:]], axis=1))
    tables = tuple(
        np.ascontiguousarray(np.concatenate([getattr(p, n) for p in parts], axis=1)[:, order]) for n in slot_names
    )
    return all_keys[order], tables


def _merged_stats(stats: list[IterationStats]) -> IterationStats:
    first = stats[0]
    counts = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in dataclasses.fields(IterationStats)
        if f.name not in ("iteration", "occupancy")
    }
    occupancy = tuple(int(sum(o)) for o in zip(*(s.occupancy for s in stats), strict=True))
    return IterationStats(iteration=first.iteration, occupancy=occupancy, **counts)
