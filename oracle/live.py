"""Planning a stream that may run dry: segments (docs/design.md#online-training).

The planner reads L + max(D, 1) batches ahead of the directives it sends, so at the live
edge of a stream the trainers would wait for data that has not arrived. `LivePlanner` ends
the plan there instead: `end_segment` finishes the planner over what has arrived (every
residency ends with a write-back, as at the end of a run), and the next batch starts a new
planner numbered from where the last one stopped. A segment is thus a run resumed at its
first iteration, except that nothing waits for a checkpoint: cache contents never change
the arithmetic (docs/design.md#exact-arithmetic), so the trainers end bit-identical however
the stream is cut.

Two things make the cut safe for the trainers, who do not know where it is:

* **The last directive of a segment syncs every key at once** (`sync_now`, none later). A
  later sum is applied at the boundary into x + 2 and holds back its rows' write-backs
  until then; the next segment's first fetches of those rows, waited for at the boundary
  into x + 1, would wait for write-backs not yet sent, or read rows a later sum has not
  reached.
* **Fetches ask for the write-backs of earlier segments.** A new planner knows no version
  written before it, so its fetches ask for -1; the write-backs of the segment before may
  still be in flight. Each fetch of directive y asks instead for at least the newest
  version of its key written in the last max(W, 3) + 1 iterations before the segment, where
  that version may not have landed (`common.directive.landed_through`).

The cuts are the plan's only input besides the data: an oracle restarted alone replays
them (`ends`) to give the trainers the very steps they had.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from common.directive import Directive
from oracle.config import PlannerConfig
from oracle.planner import Planner

if TYPE_CHECKING:
    from oracle.workers import ProcessPool


class LivePlanner:
    """`Planner`'s interface over a stream cut into segments: `push` batches as they arrive,
    `end_segment` where the stream has run dry for now, `finish` at the end of the run.

    `ends`: iterations where segments must end (those of a plan being replayed), besides
    those `end_segment` makes. `segment_ends` lists every end so far, in order.
    `make_planner` makes each segment's planner (default: a `Planner`; with P > 1 workers,
    every segment's plans in the worker processes the first one started).
    """

    def __init__(self, config: PlannerConfig, *, ends: Iterable[int] = (),
                 make_planner: Callable[[PlannerConfig], Planner] | None = None) -> None:
        self.config = config
        self._make_planner = make_planner or self._planner_in_pool
        self._pool: ProcessPool | None = None  # the segments' worker processes (P > 1)
        self._forced = sorted(e for e in ends if e > config.first_iteration)
        self.segment_ends: list[int] = []
        self._read = config.first_iteration  # the global iteration of the next batch
        self._planner: Planner | None = None
        self._segment_first = config.first_iteration
        self._carried = _Versions.empty()  # written before the current segment
        # (version, keys written with it) of the latest directives: all a carry may need
        self._recent: deque[tuple[int, np.ndarray]] = deque(maxlen=max(config.write_lag, 3) + 1)
        self._worker_cpu_s = 0.0

    @property
    def read(self) -> int:
        """The global iteration of the next batch to push."""
        return self._read

    @property
    def in_segment(self) -> bool:
        """Whether batches are planned that `end_segment` would finish."""
        return self._planner is not None

    def push(self, keys: np.ndarray) -> list[list[Directive]]:
        out: list[list[Directive]] = []
        if self._forced and self._forced[0] == self._read:
            self._forced.pop(0)
            out += self.end_segment()
        if self._planner is None:
            self._start_segment()
        assert self._planner is not None
        out += self._carry(self._planner.push(keys))
        self._read += 1
        return out

    def end_segment(self) -> list[list[Directive]]:
        """Plan everything pushed so far to its end: the trainers can train through the last
        batch pushed. The next `push` starts a new segment; nothing to end is a no-op."""
        if self._planner is None:
            return []
        out = self._carry(self._finished_planner())
        if out:
            out[-1] = [_syncing_all_now(d) for d in out[-1]]
        self.segment_ends.append(self._read)
        return out

    def finish(self) -> list[list[Directive]]:
        """End of the run: the last segment ends as a plan does (`Planner.finish`)."""
        if self._planner is None:
            return []
        return self._carry(self._finished_planner())

    def close(self) -> None:
        if self._planner is not None:
            self._planner.close()
        if self._pool is not None:
            self._pool.close()

    @property
    def keys_held(self) -> int:
        return self._planner.keys_held if self._planner is not None else 0

    @property
    def worker_cpu_s(self) -> float:
        """The planners' worker processes' CPU seconds, every segment's (`Planner.worker_cpu_s`)."""
        current = self._planner.worker_cpu_s if self._planner is not None else 0.0
        return self._worker_cpu_s + current

    # ----------------------------------------------------------------- internals
    def _planner_in_pool(self, config: PlannerConfig) -> Planner:
        """A segment's planner. A cut is where the stream runs dry, often every few
        batches at the live edge: starting P processes there (numpy, numba's kernels)
        would take seconds the trainers wait for, so the segments share one pool."""
        if config.workers == 1:
            return Planner(config)
        if self._pool is None:
            from oracle.workers import ProcessPool  # imports oracle.planner

            self._pool = ProcessPool(config)
        return Planner(config, pool=self._pool)

    def _start_segment(self) -> None:
        self._segment_first = self._read
        self._carried = _Versions.of(self._recent)
        self._planner = self._make_planner(dataclasses.replace(self.config, first_iteration=self._read))

    def _finished_planner(self) -> list[list[Directive]]:
        assert self._planner is not None
        planner, self._planner = self._planner, None
        try:
            out = planner.finish()
        finally:
            planner.close()
        self._worker_cpu_s += planner.worker_cpu_s
        return out

    def _carry(self, final: list[list[Directive]]) -> list[list[Directive]]:
        """Each directive's fetches with the versions carried from earlier segments; each
        directive's writes remembered for the segments to come."""
        out = []
        for directives in final:
            y = directives[0].iteration
            if self._carried.keys.size:
                landed = self.config.landed_through(y)
                directives = [self._carried.raise_min_versions(d, landed) for d in directives]
            # a key written by several trainers is there several times: `_Versions.of` keeps one
            self._recent.append((y, np.concatenate([d.write_keys for d in directives])))
            out.append(directives)
        return out


@dataclasses.dataclass(frozen=True)
class _Versions:
    """Keys (ascending) and the newest version each was written with."""

    keys: np.ndarray
    versions: np.ndarray

    @classmethod
    def empty(cls) -> _Versions:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def of(cls, writes: Iterable[tuple[int, np.ndarray]]) -> _Versions:
        """The newest version of each key written in `writes` ((version, keys) pairs)."""
        pairs = [(np.full(keys.size, version, np.int64), keys) for version, keys in writes]
        if not pairs:
            return cls.empty()
        versions = np.concatenate([v for v, _ in pairs])
        keys = np.concatenate([k for _, k in pairs]).astype(np.int64, copy=False)
        order = np.lexsort((-versions, keys))  # by key, newest version first
        keys, versions = keys[order], versions[order]
        first = np.concatenate(([True], keys[1:] != keys[:-1])) if keys.size else np.zeros(0, bool)
        return cls(keys[first], versions[first])

    def raise_min_versions(self, d: Directive, landed: int) -> Directive:
        """`d` with each fetch asking for at least its key's version here, where that version
        may not have landed (it is newer than `landed`)."""
        if d.prefetch_keys.size == 0:
            return d
        at = np.minimum(np.searchsorted(self.keys, d.prefetch_keys), self.keys.size - 1)
        found = self.keys[at] == d.prefetch_keys
        carried = np.where(found & (self.versions[at] > landed), self.versions[at], -1)
        if not np.any(carried > d.prefetch_min_versions):
            return d
        return dataclasses.replace(d, prefetch_min_versions=np.maximum(d.prefetch_min_versions, carried))


def _syncing_all_now(d: Directive) -> Directive:
    """`d` with its `sync_later` keys summed at once, with the `sync_now` ones."""
    if d.sync_later_keys.size == 0:
        return d
    keys = np.concatenate([d.sync_now_keys, d.sync_later_keys])
    order = np.argsort(keys, kind="stable")
    slots = np.concatenate([d.sync_now_slots, d.sync_later_slots])
    return dataclasses.replace(
        d, sync_now_keys=keys[order], sync_now_slots=slots[order],
        sync_later_keys=d.sync_later_keys[:0], sync_later_slots=d.sync_later_slots[:0],
    )
