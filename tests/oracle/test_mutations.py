"""The simulator must catch planners that break one rule of docs/design.md#the-planner, and trainers that
cross the boundary in another order (mutation tests).

Each planner mutant is the reference planner with one rule changed; each boundary mutant is
`trainer.boundary.Boundary` (what the trainers run) with two steps swapped or one dropped. A
mutant is caught when the simulator fails on at least one workload of a fixed set on which the
reference passes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from common.directive import Directive
from oracle.config import PlannerConfig
from tests.oracle.reference_planner import ReferencePlanner
from tests.oracle.simulator import SimulationError, Workload, plan_incrementally, simulate, wire
from trainer.boundary import Action, Boundary, InsertFetched, Leave, ReadJoinSources, Train, WaitWrites


class NoMinVersion(ReferencePlanner):
    """Fetches ask for any version: a re-admitted row may be read before its write-back."""

    def min_version(self, key: int, directive: int) -> int:
        return -1


class ForgetsTooEarly(ReferencePlanner):
    """A write-back's version is forgotten one directive before it has surely landed."""

    def min_version(self, key: int, directive: int) -> int:
        return super().min_version(key, directive + 1)


class ForgetsAfterW(ReferencePlanner):
    """Forgets versions W directives back even where W < 3, though rows held for sync_later
    are written back two boundaries after they leave."""

    def min_version(self, key: int, directive: int) -> int:
        version = self.last_wb.get(key, -1)
        return version if version > directive - 1 - self.cfg.write_lag else -1


class EverythingLater(ReferencePlanner):
    """sync_now is always empty: keys used at x+1 get their x update too late."""

    def used_next(self, x: int) -> set[int]:
        return set()


class EverythingNow(ReferencePlanner):
    """sync_later is never used: correct, only slower, so the simulator must accept it."""

    def used_next(self, x: int) -> set[int]:
        return set().union(*self.uses[x]) | super().used_next(x)


class UsersOnlyInG(ReferencePlanner):
    """G_x counts only copies whose trainer uses the key at x: keepers go stale."""

    def synchronised(self, x: int, key: int) -> bool:
        return sum(key in u for u in self.uses[x]) >= 2


class NoWriteAfterVictims(ReferencePlanner):
    """A residency ended by capacity victims (while planning x, version x-1) is not written."""

    planning = 0

    def plan_iteration(self, x: int) -> None:
        self.planning = x
        super().plan_iteration(x)

    def end_residency(self, e: int, key: int, leavers: list[tuple[int, int]]) -> None:
        if e == self.planning - 1:
            self.last_wb[key] = e
            return
        super().end_residency(e, key, leavers)


class KeeperDropped(ReferencePlanner):
    """The plan keeps the keeper, but its trainer is told to free the slot after x."""

    def keeper(self, x: int, key: int, copies: dict[int, int], stay: list[int]) -> list[int]:
        kept = super().keeper(x, key, copies, stay)
        if kept != stay:
            self.acc[x][kept[0]].leave.append((key, copies[kept[0]]))
        return kept


class VictimsLeaveLate(ReferencePlanner):
    """Capacity victims are listed as leaving after x instead of x-1, though their slot is
    handed out at x: the slot is written while occupied."""

    def evict(self, x: int, j: int, key: int, victims_of: dict[int, list[tuple[int, int]]]) -> None:
        super().evict(x, j, key, victims_of)
        self.acc[x][j].leave.append(self.acc[x - 1][j].leave.pop())


def _cases() -> list[tuple[PlannerConfig, list[np.ndarray], int]]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(120):
        w = Workload(
            trainers=int(rng.integers(1, 5)),
            per_trainer=int(rng.integers(1, 4)),
            features=int(rng.integers(1, 3)),
            iterations=int(rng.integers(2, 12)),
            keys=int(rng.integers(2, 20)),
            lookahead=int(rng.integers(0, 5)),
            lead=int(rng.integers(0, 6)),
            slack=int(rng.integers(0, 2)),
            mode="bagpipe",
            stream=("zipf", "uniform", "alternating")[i % 3],
            checkpoint_every=0,
            hot=0,
            seed=i,
            write_lag=(1, 2, 4)[i // 3 % 3],
        )
        config, batches = w.build()
        out.append((config, batches, i))
    return out


CASES = _cases()


def _checkpoint_cases() -> list[tuple[PlannerConfig, list[np.ndarray], int]]:
    """Bagpipe runs of several epochs with a checkpoint every 1 to 10 iterations."""
    rng = np.random.default_rng(11)
    out = []
    for i in range(80):
        w = Workload(
            trainers=int(rng.integers(2, 5)),
            per_trainer=int(rng.integers(1, 4)),
            features=int(rng.integers(1, 3)),
            iterations=int(rng.integers(3, 10)),
            keys=int(rng.integers(2, 24)),
            lookahead=int(rng.integers(0, 5)),
            lead=int(rng.integers(0, 5)),
            slack=int(rng.integers(0, 2)),
            mode="bagpipe",
            stream=("zipf", "uniform", "alternating")[i % 3],
            checkpoint_every=int(rng.integers(1, 11)),
            hot=0,
            seed=1000 + i,
            write_lag=(1, 2, 4)[i // 3 % 3],
            epochs=int(rng.integers(1, 5)),
        )
        config, batches = w.build()
        out.append((config, batches, i))
    return out


CHECKPOINT_CASES = _checkpoint_cases()


def _failures(
    planner: type[ReferencePlanner], boundary: type[Boundary] = Boundary, cases: list = CASES
) -> int:
    failures = 0
    for config, batches, seed in cases:
        try:
            simulate(config, batches, planner(config, batches).plan(), seed=seed, boundary=boundary)
        except SimulationError:
            failures += 1
    return failures


def _swapped(first: type, second: type) -> type[Boundary]:
    """`Boundary` with the actions of types `first` and `second` swapped in every plan."""

    class Swapped(Boundary):
        def plan(self, d: Directive) -> list[Action]:
            actions = super().plan(d)
            i = next(n for n, a in enumerate(actions) if isinstance(a, first))
            k = next(n for n, a in enumerate(actions) if isinstance(a, second))
            actions[i], actions[k] = actions[k], actions[i]
            return actions

    Swapped.__name__ = f"{first.__name__}After{second.__name__}"
    return Swapped


class WaitsForWritesLast(Boundary):
    """The bounded write lag is waited for at the end of x instead of at the boundary into it,
    after Train's all-reduce: other trainers may then fetch before those write-backs landed."""

    def plan(self, d: Directive) -> list[Action]:
        actions = super().plan(d)
        wait = next(a for a in actions if isinstance(a, WaitWrites))
        return [a for a in actions if a is not wait] + [wait]


class SendsHeldRowsAtOnce(Boundary):
    """A writer whose key is in sync_later(x-1) sends its row at once, without that update."""

    def plan(self, d: Directive) -> list[Action]:
        return [_no_hold(a) if isinstance(a, Leave) else a for a in super().plan(d)]

    def drain(self) -> list[Action]:
        return [_no_hold(a) if isinstance(a, Leave) else a for a in super().drain()]


def _no_hold(a: Leave) -> Leave:
    return dataclasses.replace(a, hold=np.zeros_like(a.hold))


@pytest.mark.parametrize(
    "boundary",
    [_swapped(ReadJoinSources, Leave), _swapped(InsertFetched, Train), SendsHeldRowsAtOnce, WaitsForWritesLast],
    ids=lambda b: b.__name__,
)
def test_simulator_catches_a_boundary_in_another_order(boundary: type[Boundary]) -> None:
    assert _failures(ReferencePlanner, boundary) > 0


def test_reference_passes_every_case() -> None:
    assert _failures(ReferencePlanner) == 0
    assert _failures(ReferencePlanner, cases=CHECKPOINT_CASES) == 0


class FlushIffCopyStays(Boundary):
    """The trainer of c90f137: a write counts as a checkpoint flush only where its copy stays
    cached. A flush written by a copy that leaves while another trainer keeps the row is then
    sent as a plain write-back, and the keeper's write of a later version, sent at the same
    boundary, can reach the PS first: the PS refuses the older one."""

    def _leave(self, prev: Directive | None) -> Leave:
        leave = super()._leave(prev)
        if prev is None or not len(leave.keys):
            return leave
        stays = ~np.isin(prev.write_slots, prev.leave_slots)
        if leave.hold.any():
            self._later[prev.iteration].held_flush = stays[leave.hold]
        return dataclasses.replace(leave, flush=stays)


class NoFlush(ReferencePlanner):
    """Checkpoints flush nothing: a checkpoint misses the rows still cached when it is taken."""

    def flush_candidates(self, c: int) -> dict[int, tuple[int, int]]:
        return {}


def test_simulator_catches_checkpoint_mutants() -> None:
    assert _failures(ReferencePlanner, FlushIffCopyStays, cases=CHECKPOINT_CASES) > 0
    assert _failures(NoFlush, cases=CHECKPOINT_CASES) > 0


def test_correct_but_slower_variant_passes() -> None:
    assert _failures(EverythingNow) == 0


@pytest.mark.parametrize(
    "mutant",
    [NoMinVersion, ForgetsTooEarly, ForgetsAfterW, EverythingLater, UsersOnlyInG, NoWriteAfterVictims, KeeperDropped, VictimsLeaveLate],
)
def test_simulator_catches_mutant(mutant: type[ReferencePlanner]) -> None:
    assert _failures(mutant) > 0


class NoKeeper(ReferencePlanner):
    """Rule 3 without its keeper: residencies end and are fetched again instead of joined."""

    def keeper(self, x: int, key: int, copies: dict[int, int], stay: list[int]) -> list[int]:
        return stay


def test_skipping_the_keeper_is_caught_by_equivalence() -> None:
    """Without the keeper the plan stays consistent (the simulator accepts it: the row is
    written back and fetched again), so the rule is pinned by byte-equivalence with the
    production planner and by its effect: more fetches, fewer joins."""
    differs = 0
    fetches = {NoKeeper: 0, ReferencePlanner: 0}
    for config, batches, seed in CASES:
        mutant = NoKeeper(config, batches).plan()
        simulate(config, batches, mutant, seed=seed)
        differs += wire(mutant) != wire(plan_incrementally(config, batches))
        for cls in fetches:
            fetches[cls] += sum(d.prefetch_keys.size for it in cls(config, batches).plan() for d in it)
    assert differs > 0
    assert fetches[NoKeeper] > fetches[ReferencePlanner]
