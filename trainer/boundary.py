"""The order of the boundary (docs/design.md#the-boundary) as a sans-IO protocol object.

`Boundary.plan(d)` turns trainer j's directive for iteration x into the ordered actions it
performs: the boundary into x (steps 0-5), forward and backward (6), the end of x (7).
`Boundary.drain()` gives the boundaries into N and N+1 after the last directive. The object
keeps only bookkeeping — which sync_later rounds are pending and which of their copies
stay, which rows are held back for write-back, which fetches target which iteration — and
derives every index the executor needs (gradient positions, held-row positions, hits). It
touches no tensor, socket or clock: the trainer's `Engine` executes the actions with torch
and futures, the planner simulator (tests/oracle/simulator.py) executes the very same
actions on a value model, so the order exists once.

Every plan is the same sequence of action types (an action may be empty), so the plans of
T trainers line up step by step. The collective steps (`ReadJoinSources`, `Train`,
`SyncNow`, `LaunchSyncLater`) are empty on every trainer or on none: their key lists are
identical across trainers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.arrays import find_sorted, in_sorted
from common.directive import WRITE_LAG, Directive
from trainer.kernels import end_indices, in_ascending, used_slots

_NO_I32 = np.zeros(0, np.int32)
_NO_I64 = np.zeros(0, np.int64)
_NO_BOOL = np.zeros(0, bool)
#: `_UsedSlots` indexes a table of the cache's slots up to this many slots an input, and sorts beyond.
_TABLE_PER_INPUT = 8


@dataclass(frozen=True, kw_only=True, eq=False)
class FetchGroup:
    """Rows fetched together: inserted at the boundary into `target`, step 5."""

    target: int
    keys: np.ndarray  # int64 [P]
    slots: np.ndarray  # int32 [P]
    min_versions: np.ndarray  # int64 [P]


@dataclass(frozen=True, kw_only=True, eq=False)
class IssueFetches:
    """Step 0: send these fetches at once."""

    groups: tuple[FetchGroup, ...]


@dataclass(frozen=True, kw_only=True)
class WaitWrites:
    """Wait until the PS acknowledged every write-back of a version <= `up_to` (the bounded
    write lag that lets the oracle forget old versions, docs/design.md#write-lag-and-forgetting-versions)."""

    up_to: int


@dataclass(frozen=True, kw_only=True, eq=False)
class ApplySyncLater:
    """Step 1: wait for the sum of sync_later(`iteration`) and apply it, divided by T, to the
    copies that stay (`slots`, taking row `positions[i]` of the sum) and to the rows held back
    for write-back (`held_keys`, row `held_positions[i]`), then send those at version
    `iteration` (`held_flush`: a checkpoint's flush, sent as one)."""

    iteration: int
    slots: np.ndarray  # int32
    positions: np.ndarray  # int64
    held_keys: np.ndarray  # int64
    held_positions: np.ndarray  # int64
    held_flush: np.ndarray  # bool


@dataclass(frozen=True, kw_only=True)
class CheckpointsWritten:
    """Every write-back of these checkpoint iterations has been sent (docs/design.md#checkpoints)."""

    iterations: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, eq=False)
class ReadJoinSources:
    """Step 2 (collective): the holder of each joined key reads value and state from
    `send_slots[i]` (-1 elsewhere); one collective sums them, so every trainer gets the rows
    (the others add zeros, which is exact)."""

    keys: np.ndarray  # int64 [J]
    send_slots: np.ndarray  # int32 [J]


@dataclass(frozen=True, kw_only=True, eq=False)
class Leave:
    """Step 3: copies leaving after `iteration` leave `freed`. This trainer copies out the
    rows it writes (`keys`, from `slots`); rows not in `hold` are sent at once, version
    `iteration`; held rows wait for `ApplySyncLater(iteration)`. `flush`: checkpoint
    `iteration`'s flush of a residency that goes on (`Directive.write_flush`), whether or not
    this copy leaves."""

    iteration: int
    keys: np.ndarray  # int64 [W]
    slots: np.ndarray  # int32 [W]
    flush: np.ndarray  # bool [W]
    hold: np.ndarray  # bool [W]
    freed: np.ndarray  # int32: every slot whose copy leaves, written back or not


@dataclass(frozen=True, kw_only=True, eq=False)
class WriteJoins:
    """Step 4: row `positions[i]` of the join collective goes into `slots[i]`."""

    slots: np.ndarray  # int32
    positions: np.ndarray  # int64


@dataclass(frozen=True, kw_only=True, eq=False)
class InsertFetched:
    """Step 5: wait for the fetches targeting `target` and write them into their slots."""

    target: int
    slots: np.ndarray  # int32: every slot filled, in the order the fetches were issued


@dataclass(frozen=True, kw_only=True, eq=False)
class Train:
    """Step 6 (collective: the dense gradient average): forward and backward over the rows
    at `used` (ascending unique slots); input (i, f) reads row `inverse[i, f]` of them.

    `hits`: used rows that were resident before this boundary's fetches and joins."""

    iteration: int
    used: np.ndarray  # int64 [U]
    inverse: np.ndarray  # int64 [B/T, F]
    hits: int


@dataclass(frozen=True, kw_only=True, eq=False)
class SyncNow:
    """Step 7 (collective): sum each key's gradient across trainers (this trainer's is row
    `positions[i]` of its used-row gradient, zero where -1) and apply the sum, divided by T,
    at `slots[i]` wherever it is >= 0 (copies leaving after x included)."""

    keys: np.ndarray  # int64 [N]
    slots: np.ndarray  # int32 [N]
    positions: np.ndarray  # int64 [N]


@dataclass(frozen=True, kw_only=True, eq=False)
class UpdateAlone:
    """Step 7: one-copy keys take this trainer's own gradient, divided by T."""

    slots: np.ndarray  # int32
    positions: np.ndarray  # int64


@dataclass(frozen=True, kw_only=True, eq=False)
class LaunchSyncLater:
    """Step 7 (collective, asynchronous): start summing sync_later(`iteration`); applied by
    `ApplySyncLater(iteration)` at the boundary into `iteration` + 2."""

    iteration: int
    keys: np.ndarray  # int64 [M]
    slots: np.ndarray  # int32 [M]
    positions: np.ndarray  # int64 [M]


Action = (
    IssueFetches | WaitWrites | ApplySyncLater | CheckpointsWritten | ReadJoinSources | Leave
    | WriteJoins | InsertFetched | Train | SyncNow | UpdateAlone | LaunchSyncLater
)


@dataclass
class _LaterRound:
    """A launched sync_later round: its keys, and for each this trainer's slot that stays."""

    keys: np.ndarray
    stay_slots: np.ndarray
    stay_positions: np.ndarray
    held_keys: np.ndarray = field(default_factory=lambda: _NO_I64)
    held_flush: np.ndarray = field(default_factory=lambda: _NO_BOOL)


class Boundary:
    """One trainer's bookkeeping of the boundary protocol; see the module docstring.

    Directives must come in order, one per iteration; `write_lag` is how many iterations a
    write-back may stay unacknowledged before the trainer waits for it.
    """

    def __init__(self, *, write_lag: int = WRITE_LAG) -> None:
        self.write_lag = write_lag
        self._prev: Directive | None = None
        self._later: dict[int, _LaterRound] = {}
        self._fetched: dict[int, list[np.ndarray]] = {}  # target -> slots of each fetch group
        self._checkpoints: list[int] = []  # marked iterations whose writes are not all sent

    def plan(self, d: Directive) -> list[Action]:
        """The actions of iteration `d.iteration`, in order."""
        x = d.iteration
        if self._prev is not None and x != self._prev.iteration + 1:
            raise ValueError(f"directive {x} after directive {self._prev.iteration}")
        fetches = self._issue(d)
        entering: list[Action] = [
            fetches,
            WaitWrites(up_to=x - self.write_lag),
            self._apply_later(x - 2),
            self._checkpoints_written(up_to=x - 2),
            ReadJoinSources(keys=d.join_keys, send_slots=d.join_send_slots),
            self._leave(self._prev),
            _write_joins(d),
        ]
        inserted = InsertFetched(target=x, slots=_concat(self._fetched.pop(x, []), np.int32))
        used = _UsedSlots(d, inserted.slots)
        train = _train(d, used, inserted.slots)
        actions = [*entering, inserted, train, *self._end(d, used)]
        self._prev = d
        if d.checkpoint:
            self._checkpoints.append(x)
        return actions

    def drain(self) -> list[Action]:
        """After the last directive N-1: the boundaries into N (steps 1 and 3) and N+1 (step
        1), so every held-back write-back is sent. ValueError if a fetch was never used."""
        if self._fetched:
            raise ValueError(f"fetches for iterations {sorted(self._fetched)} were never used")
        if self._prev is None:
            return []
        n = self._prev.iteration + 1
        actions: list[Action] = [self._apply_later(n - 2), self._leave(self._prev)]
        self._prev = None
        actions += [self._apply_later(n - 1), self._checkpoints_written(up_to=n)]
        return actions

    # -- the boundary into x -----------------------------------------------------------

    def _issue(self, d: Directive) -> IssueFetches:
        groups = []
        for target, part in _by_target(d.prefetch_targets):
            group = FetchGroup(
                target=target, keys=d.prefetch_keys[part], slots=d.prefetch_slots[part],
                min_versions=d.prefetch_min_versions[part],
            )
            self._fetched.setdefault(group.target, []).append(group.slots)
            groups.append(group)
        return IssueFetches(groups=tuple(groups))

    def _apply_later(self, e: int) -> ApplySyncLater:
        later = self._later.pop(e, None)
        if later is None:
            return ApplySyncLater(
                iteration=e, slots=_NO_I32, positions=_NO_I64, held_keys=_NO_I64,
                held_positions=_NO_I64, held_flush=_NO_BOOL,
            )
        return ApplySyncLater(
            iteration=e, slots=later.stay_slots, positions=later.stay_positions,
            held_keys=later.held_keys, held_positions=np.searchsorted(later.keys, later.held_keys),
            held_flush=later.held_flush,
        )

    def _checkpoints_written(self, up_to: int) -> CheckpointsWritten:
        done = tuple(c for c in self._checkpoints if c <= up_to)
        self._checkpoints = self._checkpoints[len(done):]
        return CheckpointsWritten(iterations=done)

    def _leave(self, prev: Directive | None) -> Leave:
        if prev is None:
            return Leave(iteration=-1, keys=_NO_I64, slots=_NO_I32, flush=_NO_BOOL, hold=_NO_BOOL, freed=_NO_I32)
        keys = prev.write_keys
        hold = in_ascending(_int64(keys), _int64(prev.sync_later_keys))
        flush = prev.write_flush.astype(bool)
        if hold.any():
            later = self._later[prev.iteration]
            later.held_keys, later.held_flush = keys[hold], flush[hold]
        return Leave(
            iteration=prev.iteration, keys=keys, slots=prev.write_slots, flush=flush, hold=hold,
            freed=prev.leave_slots,
        )

    # -- the end of x ------------------------------------------------------------------

    def _end(self, d: Directive, used: _UsedSlots) -> list[Action]:
        end = used.end_indices(d)
        if len(d.sync_later_keys):
            self._later[d.iteration] = _LaterRound(
                keys=d.sync_later_keys, stay_slots=end.stay_slots, stay_positions=end.stay_positions,
            )
        return [
            SyncNow(keys=d.sync_now_keys, slots=d.sync_now_slots, positions=end.now_positions),
            UpdateAlone(slots=end.alone_slots, positions=end.alone_positions),
            LaunchSyncLater(
                iteration=d.iteration, keys=d.sync_later_keys, slots=d.sync_later_slots,
                positions=end.later_positions,
            ),
        ]


def _by_target(targets: np.ndarray) -> list[tuple[int, slice | np.ndarray]]:
    """The prefetches of each target, ascending by target, each in the directive's order:
    slices where the targets ascend (as the planner sends them: no copy, no hashing), else
    the indices of a stable sort."""
    if not targets.size:
        return []
    order: np.ndarray | None = None
    if not bool((targets[1:] >= targets[:-1]).all()):
        order = np.argsort(targets, kind="stable")
        targets = targets[order]
    cuts = [0, *(np.flatnonzero(targets[1:] != targets[:-1]) + 1).tolist(), targets.size]
    return [(int(targets[a]), slice(a, b) if order is None else order[a:b]) for a, b in zip(cuts, cuts[1:])]


def _write_joins(d: Directive) -> WriteJoins:
    positions = np.flatnonzero(d.join_recv_slots >= 0)
    return WriteJoins(slots=d.join_recv_slots[positions], positions=positions)


@dataclass(frozen=True, eq=False)
class EndIndices:
    """The indices the end of an iteration needs, among the used slots (`_UsedSlots`)."""

    now_positions: np.ndarray  # int64: each sync_now slot's index among the used slots, or -1
    later_positions: np.ndarray  # int64: the same for each sync_later slot
    alone_positions: np.ndarray  # int64: the used slots in neither sync list, ascending
    alone_slots: np.ndarray  # int32: those slots
    stay_positions: np.ndarray  # int64: the sync_later entries whose copy stays after x
    stay_slots: np.ndarray  # int32: their slots


class _UsedSlots:
    """The slots iteration x reads, ascending and unique, and each slot's index among them.

    Slots are below the cache's capacity C. Where C is not much more than the inputs, a
    table over the slots replaces sorting: O(C + n) in one kernel (`trainer.kernels.used_slots`),
    where `np.unique` sorts the inputs of every iteration. Where the cache dwarfs the inputs
    (`local` mode holds every row of the tables), sorting them is the cheaper: O(n log n)."""

    def __init__(self, d: Directive, fetched: np.ndarray) -> None:
        flat = np.ascontiguousarray(d.input_slots, np.int32).ravel()
        if flat.size and flat.min() < 0:
            raise ValueError(f"directive {d.iteration}: an input without a slot")
        size = _table_size(flat, fetched, d.join_recv_slots, d.sync_now_slots, d.sync_later_slots)
        self._index: np.ndarray | None  # by slot, its index among the used ones; [-1] answers slot -1
        if size <= _TABLE_PER_INPUT * flat.size:
            self.slots, self._index, inverse = used_slots(flat, size)
        else:
            slots, inverse = np.unique(flat, return_inverse=True)
            self.slots, self._index, inverse = slots.astype(np.int64), None, inverse.astype(np.int64)
        self.inverse = inverse.reshape(d.input_slots.shape)

    def positions(self, slots: np.ndarray) -> np.ndarray:
        """For each slot, its index among the used slots, or -1 (not used, or -1 itself)."""
        return self._index[slots] if self._index is not None else find_sorted(slots, self.slots)

    def count_in(self, slots: np.ndarray) -> int:
        """How many used slots are among `slots`."""
        among = np.zeros(len(self.slots) + 1, bool)  # the last entry answers the slots not used
        among[self.positions(slots)] = True
        return int(np.count_nonzero(among[:-1]))

    def end_indices(self, d: Directive) -> EndIndices:
        """The indices of iteration `d`'s end: over the table in one kernel
        (`trainer.kernels.end_indices`), else in numpy."""
        if self._index is not None:
            return EndIndices(*end_indices(self._index, self.slots, _int32(d.sync_now_slots),
                                           _int32(d.sync_later_slots), _int32(d.leave_slots)))
        now, later = self.positions(d.sync_now_slots), self.positions(d.sync_later_slots)
        alone = self.not_at(now, later)
        stay = np.flatnonzero((d.sync_later_slots >= 0) & ~_slots_in(d.sync_later_slots, d.leave_slots))
        return EndIndices(now, later, alone, self.slots[alone].astype(np.int32), stay,
                          d.sync_later_slots[stay].astype(np.int32))

    def not_at(self, *position_lists: np.ndarray) -> np.ndarray:
        """The indices of the used slots at none of the `positions` of the lists (-1: none),
        ascending."""
        left = np.ones(len(self.slots) + 1, bool)
        for positions in position_lists:
            left[positions] = False
        return np.flatnonzero(left[:-1])


def _train(d: Directive, used: _UsedSlots, fetched: np.ndarray) -> Train:
    filled = np.concatenate([fetched, d.join_recv_slots[d.join_recv_slots >= 0]])
    return Train(
        iteration=d.iteration, used=used.slots.astype(np.int64), inverse=used.inverse,
        hits=len(used.slots) - used.count_in(filled),
    )


def _slots_in(slots: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """``np.isin(slots, pool)`` for slot lists (-1 is in neither): by a table over the slots
    where it is small against the lists (as in a cache), else by sorting the pool."""
    size = _table_size(slots, pool)
    if size > _TABLE_PER_INPUT * (slots.size + pool.size):
        return in_sorted(slots, np.sort(pool)) & (slots >= 0)
    table = np.zeros(size + 1, bool)  # the last entry answers slot -1
    table[pool] = True
    table[-1] = False
    return table[slots]


def _int32(slots: np.ndarray) -> np.ndarray:
    """Slots as the kernels take them: contiguous int32 (a directive's already are)."""
    return np.ascontiguousarray(slots, np.int32)


def _int64(keys: np.ndarray) -> np.ndarray:
    """Keys as the kernels take them: contiguous int64 (a directive's already are)."""
    return np.ascontiguousarray(keys, np.int64)


def _table_size(*slot_lists: np.ndarray) -> int:
    """Entries a table needs to be indexed by every slot of the lists; at least 1, so that
    where every slot is -1, -1 reads the one entry."""
    return max(1, 1 + max((int(a.max()) for a in slot_lists if a.size), default=0))


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
