"""Replays directives against simulated trainers, PS and network, with real values (docs/design.md#verification).

Each trainer has a cache of C slots holding (key, value[2], adagrad state) in float64. A
pseudo-gradient depends on (iteration, trainer, key) and on the value read, so a stale read
changes every later value. A single-process reference applies the same updates to a full table.
Trainers execute the actions of `trainer.boundary.Boundary` — the production implementation
of the boundary (docs/design.md#the-boundary), which the trainer's engine executes too — in lockstep
(their collectives make them so), checking every index the actions carry; the PS and network
are asynchronous: write-backs arrive at random times, fetches are served at random times once
the PS version reaches their `min_version`, from the moment they are issued. A trainer waiting
for a fetch lets the network deliver what is in flight; if the write-back it needs has not been
sent, that is a deadlock. Each run picks a delivery order: random, or the worst one, newest
version first, so that writes that different trainers send at one boundary land against the
order of their versions whenever nothing forces them apart.

The PS applies the version rules of `ps.store.ShardStore.check_write`: a write-back whose
version is not above the stored one is refused, unless it is a checkpoint flush (then it is
refused only at the stored version itself, and a late one goes to its checkpoint alone). A
refused write-back is a failed checkpoint in a real run, so here it is a `SimulationError`.

`simulate` raises `SimulationError` at the first broken invariant of §4: reads see every
earlier update (value and state, bit for bit); slots stay in [0, C) and are never written
while occupied; exactly one write-back per residency end (checkpoint flushes aside), each
carrying the reference value of its version; a fetch gets exactly the newest version written
back before it was issued, or the version it asked for if that is newer, and never
deadlocks; join and sync key lists are identical across trainers; each checkpoint's PS view
equals the reference; the final PS table equals the reference.

Lockstep hides one thing: in a real run only the collectives hold trainers together, so a
trainer may issue directive y's fetches while another is still anywhere between Train(y-1)
and its own fetches of y. A fetch that asks for less than the newest version written back
(a min_version of -1 for a write-back that has landed) is therefore checked against the
write-backs that a `WaitWrites` had forced to land before Train(y-1) began, the last point
every trainer had surely passed; one that landed by chance does not count.

With `config.first_iteration` = F > 0 (a run resumed from checkpoint F-1) iterations are
numbered from F and the PS starts with each key at a random version in [-1, F-1], which a
fetch gets unless a newer one was written back since.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from common.directive import Directive
from oracle.config import PlannerConfig, required_capacity
from oracle.planner import Planner
from oracle.stats import PlannerStats
from oracle.workers import InProcessPool, ParallelPlanner
from trainer.boundary import (
    Action,
    ApplySyncLater,
    Boundary,
    CheckpointsWritten,
    InsertFetched,
    IssueFetches,
    LaunchSyncLater,
    Leave,
    ReadJoinSources,
    SyncNow,
    Train,
    UpdateAlone,
    WaitWrites,
    WriteJoins,
)

LR = 0.1
WRITE_LAG = 4  # small enough that the bounded write lag (`WaitWrites`) and the min_versions it
# lets the planner forget (`PlannerConfig.landed_through`) act in short streams


class SimulationError(AssertionError):
    """A directive stream broke an invariant of docs/design.md#invariants."""


Row = tuple[float, float, float]  # value[0], value[1], adagrad state


def initial_row(key: int) -> Row:
    return (math.sin(key * 1.7 + 0.3), math.cos(key * 0.9), 0.0)


def gradient(x: int, trainer: int, key: int, row: Row) -> tuple[float, float]:
    base = math.sin(x * 0.37 + trainer * 1.3 + key * 0.71)
    return (base + 0.5 * row[0], 0.25 * base - 0.5 * row[1])


def apply(row: Row, grad: tuple[float, float]) -> Row:
    """Row-wise Adagrad: one state per row."""
    state = row[2] + (grad[0] * grad[0] + grad[1] * grad[1]) / 2.0
    scale = LR / (math.sqrt(state) + 1e-3)
    return (row[0] - scale * grad[0], row[1] - scale * grad[1], state)


def reduce(grads: list[tuple[float, float] | None], num_trainers: int) -> tuple[float, float]:
    """The all-reduce (SUM, trainer order, zeros for non-users) divided by T."""
    a = b = 0.0
    for g in grads:
        a += g[0] if g is not None else 0.0
        b += g[1] if g is not None else 0.0
    return (a / num_trainers, b / num_trainers)


@dataclass
class _Trainer:
    cache: dict[int, tuple[int, Row]] = field(default_factory=dict)  # slot -> key, row
    held: dict[int, list[tuple[int, Row]]] = field(default_factory=dict)  # version -> key, row
    grads: dict[int, tuple[float, float]] = field(default_factory=dict)  # key -> its gradient at x
    used: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # Train.used at x


@dataclass(frozen=True)
class _Write:
    """A write-back in flight: `flush` is a checkpoint's copy of a residency that goes on."""

    key: int
    version: int
    row: Row
    flush: bool


@dataclass
class _Fetch:
    trainer: int
    key: int
    slot: int
    min_version: int
    target: int
    expected: int  # the version it must get
    row: Row | None = None


class Simulation:
    """One replay; see `simulate`."""

    def __init__(self, config: PlannerConfig, batches: list[np.ndarray], seed: int, boundary: type[Boundary] = Boundary) -> None:
        self.cfg = config
        self.boundary = boundary
        self.T = config.num_trainers
        self.first = config.first_iteration
        self.batches = batches  # batch i is iteration first + i
        self.rng = random.Random(seed)
        # how likely a write-back in flight lands at each chance: a slow network keeps them
        # in flight until the bounded write lag forces them
        self.delivery = self.rng.choice((0.5, 0.1))
        self.local = config.mode == "local"
        self.ref: dict[int, Row] = {}
        self.ref_history: dict[int, list[tuple[int, Row]]] = {}
        self.ps: dict[int, tuple[int, Row]] = {}  # key -> version, row
        self.ps_writes: dict[int, list[tuple[int, Row]]] = {}
        self.in_flight: list[_Write] = []
        self.newest_first = self.rng.random() < 0.5  # the delivery order (module docstring)
        self.fetches: list[_Fetch] = []
        self.trainers = [_Trainer() for _ in range(self.T)]
        self.later: dict[int, tuple[list[int], list[tuple[float, float]]]] = {}  # x -> keys, sums / T
        self.write_lag = config.write_lag
        self.x = config.first_iteration
        self.directives: list[Directive] = []  # of iteration x
        self.joined: dict[int, Row] = {}  # key -> row read by its join source at x
        self.join_keys: list[int] = []
        self.leaving: int | None = None  # copies left after this iteration: check residency ends
        self.sent: dict[int, dict[int, int]] = {}  # version -> key -> write count
        self.flushed: dict[int, set[int]] = {}  # version -> keys written as checkpoint flushes
        self.resident: dict[int, set[int]] = {}
        self.resumed: dict[int, int] = self.resumed_versions()  # key -> version before F
        self.newest_sent = dict(self.resumed)  # key -> newest version written back so far
        self.unsure: set[tuple[int, int]] = set()  # (key, version) sent, not yet forced by a WaitWrites
        self.unsure_at_train: set[tuple[int, int]] = set()  # `unsure` when Train began
        self.sent_since_train: set[int] = set()  # keys written back since Train began
        self.ps = {k: (v, initial_row(k)) for k, v in self.resumed.items() if v >= 0}
        if self.local:
            for t in self.trainers:
                t.cache = {k: (k, initial_row(k)) for k in range(config.total_rows)}

    # ----------------------------------------------------------------- helpers
    def resumed_versions(self) -> dict[int, int]:
        """Versions the PS holds when the run starts at F: random in [-1, F-1] (none if F = 0)."""
        if self.first == 0 or self.local:
            return {}
        keys = sorted({int(k) for b in self.batches for k in b.reshape(-1)})
        return {k: self.rng.randrange(-1, self.first) for k in keys}

    def fail(self, message: str) -> None:
        raise SimulationError(message)

    def ref_row(self, key: int) -> Row:
        return self.ref.get(key, initial_row(key))

    def ref_at(self, key: int, version: int) -> Row:
        """Reference row after every update up to and including iteration `version`."""
        row = initial_row(key)
        for it, r in self.ref_history.get(key, []):
            if it > version:
                break
            row = r
        return row

    def send(self, key: int, version: int, row: Row, flush: bool) -> None:
        if row != self.ref_at(key, version):
            self.fail(f"write-back of key {key} version {version} carries a stale row")
        if flush and not self.cfg.is_checkpoint(version):
            self.fail(f"flush of key {key} with version {version}, not a checkpoint")
        self.newest_sent[key] = max(version, self.newest_sent.get(key, -1))
        self.sent_since_train.add(key)
        self.unsure.add((key, version))
        self.in_flight.append(_Write(key, version, row, flush))

    def deliver(self, w: _Write) -> None:
        """The PS's version rules (module docstring): a refusal fails the simulation."""
        stored = self.ps.get(w.key, (-1, initial_row(w.key)))[0]
        if w.version == stored or (w.version < stored and not w.flush):
            kind = "flush" if w.flush else "write-back"
            self.fail(
                f"the PS refuses the {kind} of key {w.key} with version {w.version}: it is already "
                f"at version {stored}"
            )
        self.ps_writes.setdefault(w.key, []).append((w.version, w.row))
        if w.version > stored:
            self.ps[w.key] = (w.version, w.row)

    def in_delivery_order(self) -> list[_Write]:
        """What is in flight, in this run's delivery order."""
        self.rng.shuffle(self.in_flight)
        if self.newest_first:
            self.in_flight.sort(key=lambda w: -w.version)  # stable: ties stay shuffled
        return self.in_flight

    def network(self) -> None:
        """Random progress: some write-backs land, some eligible fetches are served."""
        keep = []
        for w in self.in_delivery_order():
            (self.deliver if self.rng.random() < self.delivery else keep.append)(w)
        self.in_flight = keep
        for f in self.fetches:
            if f.row is None and self.rng.random() < 0.5:
                self.serve(f)

    def serve(self, f: _Fetch) -> bool:
        version, row = self.ps.get(f.key, (-1, initial_row(f.key)))
        if version < f.min_version:
            return False
        if version != f.expected:
            self.fail(
                f"fetch of key {f.key} for {f.target} (min_version {f.min_version}) needs version "
                f"{f.expected}, PS has {version}"
            )
        f.row = row
        return True

    def wait(self, f: _Fetch) -> None:
        """The trainer blocks: in-flight write-backs land (in delivery order) until f is served."""
        self.in_delivery_order().reverse()  # popped from the end
        while f.row is None and not self.serve(f):
            if not self.in_flight:
                self.fail(
                    f"deadlock: trainer {f.trainer} waits for key {f.key} version {f.min_version} "
                    f"at iteration {f.target}, which nobody has sent"
                )
            self.deliver(self.in_flight.pop())

    def read_slot(self, j: int, slot: int, key: int, what: str) -> Row:
        """Trainer j's row in `slot`, which must hold `key`."""
        held, row = self.trainers[j].cache.get(slot, (-1, initial_row(0)))
        if held != key:
            self.fail(f"trainer {j}: {what} expects key {key} in slot {slot}, which holds {held}")
        return row

    def write_slot(self, t: _Trainer, j: int, slot: int, key: int, row: Row) -> None:
        if not 0 <= slot < self.cfg.capacity and not self.local:
            self.fail(f"trainer {j} slot {slot} outside [0, {self.cfg.capacity})")
        if slot in t.cache:
            self.fail(f"trainer {j} writes slot {slot} while key {t.cache[slot][0]} occupies it")
        t.cache[slot] = (key, row)

    # ----------------------------------------------------------------- one iteration
    def run(self, directives: list[list[Directive]]) -> None:
        n, first = len(self.batches), self.first
        if len(directives) != n:
            self.fail(f"{len(directives)} directive iterations for {n} batches")
        boundaries = [self.boundary(write_lag=self.write_lag) for _ in range(self.T)]
        for x in range(first, first + n):
            ds = directives[x - first]
            self.check_lists(x, ds)
            self.x, self.directives = x, ds
            self.execute([b.plan(d) for b, d in zip(boundaries, ds)])
            self.network()
            self.resident[x] = self.keys_resident()
        self.execute([b.drain() for b in boundaries])
        for w in self.in_delivery_order():
            self.deliver(w)
        self.in_flight = []
        self.final_checks(n)

    def check_lists(self, x: int, ds: list[Directive]) -> None:
        for name in ("join_keys", "sync_now_keys", "sync_later_keys"):
            if any(not np.array_equal(getattr(d, name), getattr(ds[0], name)) for d in ds):
                self.fail(f"{name} of iteration {x} differ across trainers")
        if any(d.iteration != x or d.trainer != j for j, d in enumerate(ds)):
            self.fail(f"directives of iteration {x} are mislabelled")

    def execute(self, plans: list[list[Action]]) -> None:
        """The trainers' plans in lockstep, one action of each at a time (their collectives
        make them so); the PS and the network run in between."""
        if len({tuple(type(a) for a in plan) for plan in plans}) != 1:
            self.fail("the trainers' plans differ in their sequence of actions")
        for step in zip(*plans):
            getattr(self, _HANDLER[type(step[0])])(list(step))
        if self.leaving is not None:
            self.check_residency_ends(self.leaving)

    # ----------------------------------------------------------------- the boundary into x
    def issue_fetches(self, actions: list[IssueFetches]) -> None:
        """The PS may answer a fetch the moment it arrives, before any other trainer moves."""
        for j, a in enumerate(actions):
            for g in a.groups:
                for k, s, v in zip(g.keys, g.slots, g.min_versions):
                    key = int(k)
                    newest = self.newest_sent.get(key, -1)
                    if int(v) < newest and (key in self.sent_since_train or (key, newest) in self.unsure_at_train):
                        self.fail(
                            f"trainer {j} fetches key {key} with min_version {int(v)} at {self.x}, but "
                            f"its write-back of version {newest} had not surely landed when Train({self.x - 1}) began"
                        )
                    expected = max(int(v), newest)
                    f = _Fetch(j, key, int(s), int(v), g.target, expected)
                    self.fetches.append(f)
                    if self.rng.random() < 0.5:
                        self.serve(f)

    def wait_writes(self, actions: list[WaitWrites]) -> None:
        """The bounded write lag: every write-back of a version <= up_to lands now."""
        up_to = actions[0].up_to
        self.unsure = {(key, version) for key, version in self.unsure if version > up_to}
        due = [w for w in self.in_delivery_order() if w.version <= up_to]
        self.in_flight = [w for w in self.in_flight if w.version > up_to]
        for w in due:
            self.deliver(w)

    def apply_sync_later(self, actions: list[ApplySyncLater]) -> None:
        e = actions[0].iteration
        keys, reduced = self.later.pop(e, ([], []))
        for j, a in enumerate(actions):
            t = self.trainers[j]
            for s, pos in zip(a.slots, a.positions):
                key = keys[int(pos)]
                t.cache[int(s)] = (key, apply(self.read_slot(j, int(s), key, f"sync_later({e})"), reduced[int(pos)]))
            held = t.held.pop(e, [])
            if [k for k, _ in held] != [int(k) for k in a.held_keys]:
                self.fail(f"trainer {j}: rows held after {e} are not the ones sync_later({e}) updates")
            for (key, row), pos, flush in zip(held, a.held_positions, a.held_flush):
                if keys[int(pos)] != key:
                    self.fail(f"trainer {j}: held row of key {key} takes the sync_later gradient of {keys[int(pos)]}")
                self.send(key, e, apply(row, reduced[int(pos)]), bool(flush))

    def checkpoints_written(self, actions: list[CheckpointsWritten]) -> None:
        """Checkpoints are checked at the end, from every write the PS received."""

    def read_join_sources(self, actions: list[ReadJoinSources]) -> None:
        self.joined = {}
        for j, a in enumerate(actions):
            for k, s in zip(a.keys, a.send_slots):
                if s >= 0:
                    if int(k) in self.joined:
                        self.fail(f"two join sources for key {int(k)}")
                    self.joined[int(k)] = self.read_slot(j, int(s), int(k), "join source")
        self.join_keys = [int(k) for k in actions[0].keys]

    def leave(self, actions: list[Leave]) -> None:
        e = actions[0].iteration
        for j, a in enumerate(actions):
            t = self.trainers[j]
            for k, s, hold, flush in zip(a.keys, a.slots, a.hold, a.flush):
                key = int(k)
                row = self.read_slot(j, int(s), key, f"write-back after {e}")
                self.sent.setdefault(e, {}).setdefault(key, 0)
                self.sent[e][key] += 1
                if flush:
                    self.flushed.setdefault(e, set()).add(key)
                if hold:
                    t.held.setdefault(e, []).append((key, row))
                else:
                    self.send(key, e, row, bool(flush))
            for s in a.freed:
                if int(s) not in t.cache:
                    self.fail(f"trainer {j} frees empty slot {int(s)} after {e}")
                del t.cache[int(s)]
        if e >= self.first and not self.local:
            self.leaving = e

    def write_joins(self, actions: list[WriteJoins]) -> None:
        for j, a in enumerate(actions):
            for s, pos in zip(a.slots, a.positions):
                key = self.join_keys[int(pos)]
                if key not in self.joined:
                    self.fail(f"trainer {j} joins key {key} that nobody sends")
                self.write_slot(self.trainers[j], j, int(s), key, self.joined[key])
        if self.leaving is not None:
            self.check_residency_ends(self.leaving)

    def insert_fetched(self, actions: list[InsertFetched]) -> None:
        x = actions[0].target
        due = [f for f in self.fetches if f.target == x]
        self.fetches = [f for f in self.fetches if f.target != x]
        for j, a in enumerate(actions):
            if sorted(f.slot for f in due if f.trainer == j) != sorted(int(s) for s in a.slots):
                self.fail(f"trainer {j} inserts other slots at {x} than its fetches target")
        for f in due:
            self.wait(f)
            assert f.row is not None
            self.write_slot(self.trainers[f.trainer], f.trainer, f.slot, f.key, f.row)

    def check_residency_ends(self, e: int) -> None:
        """Keys resident during e and gone now ended after e: one write-back of version e, not
        a flush; a key written while its residency goes on was flushed once, as a flush (only
        a flush may land after a newer version, as a residency's next write can)."""
        self.leaving = None
        ended = self.resident.get(e, set()) - self.keys_resident()
        written, flushed = self.sent.get(e, {}), self.flushed.get(e, set())
        for key in ended:
            if written.get(key, 0) != 1:
                self.fail(f"residency of key {key} ended after {e} with {written.get(key, 0)} write-backs")
            if key in flushed:
                self.fail(f"residency of key {key} ended after {e} with a flush, not a write-back")
        for key, count in written.items():
            if key not in ended and not (self.cfg.is_checkpoint(e) and count == 1):
                self.fail(f"key {key} written {count} times with version {e} but its residency goes on")
            if key not in ended and key not in flushed:
                self.fail(f"key {key} written with version {e} while its residency goes on, not as a flush")

    def keys_resident(self) -> set[int]:
        return {key for t in self.trainers for key, _ in t.cache.values()}

    # ----------------------------------------------------------------- forward, the end of x
    def train(self, actions: list[Train]) -> None:
        self.unsure_at_train = set(self.unsure)
        self.sent_since_train = set()
        self.network()
        x, ds = self.x, self.directives
        batch = self.batches[x - self.first]
        per = batch.shape[0] // self.T
        users: dict[int, list[tuple[float, float] | None]] = {}
        for j, (a, d) in enumerate(zip(actions, ds)):
            t = self.trainers[j]
            t.grads, t.used = {}, a.used
            part = batch[j * per : (j + 1) * per]
            if d.input_slots.shape != part.shape or not np.array_equal(a.used[a.inverse], d.input_slots):
                self.fail(f"trainer {j} at {x} trains on other slots than its input_slots")
            for k, s in zip(part.reshape(-1), d.input_slots.reshape(-1)):
                key = int(k)
                row = self.read_slot(j, int(s), key, f"input at {x}")
                if row != self.ref_row(key):
                    self.fail(f"trainer {j} at {x} reads a stale row of key {key} from slot {int(s)}")
                if key not in t.grads:
                    t.grads[key] = gradient(x, j, key, row)
            for key in t.grads:
                users.setdefault(key, [None] * self.T)[j] = t.grads[key]
        self.reference_step(x, users)

    def reference_step(self, x: int, users: dict[int, list[tuple[float, float] | None]]) -> None:
        for key in sorted(users):
            row = apply(self.ref_row(key), reduce(users[key], self.T))
            self.ref[key] = row
            self.ref_history.setdefault(key, []).append((x, row))

    def local_grad(self, j: int, position: int) -> tuple[float, float] | None:
        """Trainer j's gradient for row `position` of its used slots (None: -1, zeros)."""
        if position < 0:
            return None
        t = self.trainers[j]
        return t.grads[t.cache[int(t.used[position])][0]]

    def summed(self, actions: list[SyncNow] | list[LaunchSyncLater]) -> tuple[list[int], list[tuple[float, float]]]:
        """The keys of a sync list and the sum of every trainer's gradient, divided by T."""
        keys = [int(k) for k in actions[0].keys]
        if not set(keys) <= set().union(*(t.grads for t in self.trainers)):
            self.fail(f"sync lists of {self.x} name keys nobody used")
        grads = [reduce([self.local_grad(j, int(a.positions[i])) for j, a in enumerate(actions)], self.T) for i in range(len(keys))]
        return keys, grads

    def sync_now(self, actions: list[SyncNow]) -> None:
        keys, grads = self.summed(actions)
        for j, a in enumerate(actions):
            for i, s in enumerate(a.slots):
                if s >= 0:
                    row = self.read_slot(j, int(s), keys[i], f"sync_now({self.x})")
                    self.trainers[j].cache[int(s)] = (keys[i], apply(row, grads[i]))

    def update_alone(self, actions: list[UpdateAlone]) -> None:
        for j, a in enumerate(actions):
            t = self.trainers[j]
            for s, pos in zip(a.slots, a.positions):
                key, row = t.cache[int(s)]
                g = self.local_grad(j, int(pos))
                assert g is not None
                t.cache[int(s)] = (key, apply(row, (g[0] / self.T, g[1] / self.T)))

    def launch_sync_later(self, actions: list[LaunchSyncLater]) -> None:
        self.later[actions[0].iteration] = self.summed(actions)

    # ----------------------------------------------------------------- the end
    def final_checks(self, n: int) -> None:
        if self.local:
            for j, t in enumerate(self.trainers):
                for key, (_, row) in t.cache.items():
                    if row != self.ref_row(key):
                        self.fail(f"local trainer {j} ends with a wrong row for key {key}")
            return
        for j, t in enumerate(self.trainers):
            if t.cache or t.held:
                self.fail(f"trainer {j} still holds rows after the stream: {sorted(t.cache)}")
        if self.fetches:
            self.fail(f"{len(self.fetches)} fetches were never inserted")
        for key in self.ref:
            if self.ps.get(key, (-1, initial_row(key)))[1] != self.ref[key]:
                self.fail(f"final PS row of key {key} differs from the reference")
        for c in range(self.first, self.first + n - 1):
            if self.cfg.is_checkpoint(c):
                self.check_checkpoint(c)

    def check_checkpoint(self, c: int) -> None:
        """A PS snapshot of the writes with version <= c equals the reference at the end of c."""
        for key in self.ref:
            versions = [(v, r) for v, r in self.ps_writes.get(key, []) if v <= c]
            row = max(versions)[1] if versions else initial_row(key)
            if row != self.ref_at(key, c):
                self.fail(f"checkpoint {c}: PS row of key {key} is not the reference's")


_HANDLER = {
    IssueFetches: "issue_fetches",
    WaitWrites: "wait_writes",
    ApplySyncLater: "apply_sync_later",
    CheckpointsWritten: "checkpoints_written",
    ReadJoinSources: "read_join_sources",
    Leave: "leave",
    WriteJoins: "write_joins",
    InsertFetched: "insert_fetched",
    Train: "train",
    SyncNow: "sync_now",
    UpdateAlone: "update_alone",
    LaunchSyncLater: "launch_sync_later",
}


def simulate(
    config: PlannerConfig, batches: list[np.ndarray], directives: list[list[Directive]], seed: int = 0,
    boundary: type[Boundary] = Boundary,
) -> None:
    """Replay `directives` (per iteration, per trainer) for `batches`, the trainers following
    `boundary`; SimulationError if any invariant of docs/design.md#invariants breaks."""
    Simulation(config, [np.asarray(b, dtype=np.int64) for b in batches], seed, boundary).run(directives)


# --------------------------------------------------------------------------- workloads
STREAMS = ("zipf", "uniform", "equal", "distinct", "alternating")
MODES = ("bagpipe", "no-cache", "static-cache", "local")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A small random planning problem; `build` turns it into (config, batches)."""

    trainers: int
    per_trainer: int
    features: int
    iterations: int
    keys: int
    lookahead: int
    lead: int
    slack: int  # C - the tightest feasible C
    mode: str
    stream: str
    checkpoint_every: int
    hot: int
    seed: int
    write_lag: int = WRITE_LAG
    epochs: int = 1  # the stream read this many times over, as a run of several epochs does
    workers: int = 1  # planner workers (bagpipe): keys planned in that many partitions

    def batches(self) -> list[np.ndarray]:
        return self.epoch() * self.epochs

    def epoch(self) -> list[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        t, per, f, n, k = self.trainers, self.per_trainer, self.features, self.iterations, self.keys
        shape = (t * per, f)
        if self.stream == "zipf":
            return [(rng.zipf(1.4, size=shape) - 1) % k for _ in range(n)]
        if self.stream == "uniform":
            return [rng.integers(0, k, size=shape) for _ in range(n)]
        if self.stream == "equal":
            return [np.full(shape, self.seed % k) for _ in range(n)]
        if self.stream == "distinct":
            size = t * per * f
            return [np.arange(x * size, (x + 1) * size).reshape(shape) for x in range(n)]
        # alternating: a small shared pool moves from trainer to trainer every iteration
        out = []
        for x in range(n):
            b = rng.integers(k, 2 * k + 1, size=shape)
            owner = x % t
            b[owner * per : (owner + 1) * per] = rng.integers(0, max(1, k // 4), size=(per, f))
            out.append(b)
        return out

    def build(self) -> tuple[PlannerConfig, list[np.ndarray]]:
        batches = [np.asarray(b, dtype=np.int64) for b in self.batches()]
        total = int(max(int(b.max()) for b in batches)) + 1
        hot = np.unique(np.concatenate(batches).reshape(-1)[: self.hot]) if self.mode == "static-cache" else None
        base = PlannerConfig(
            num_trainers=self.trainers,
            lookahead=self.lookahead,
            prefetch_lead=self.lead,
            capacity=1 << 30,
            mode=self.mode,  # type: ignore[arg-type]
            checkpoint_every=self.checkpoint_every,
            total_rows=total,
            write_lag=self.write_lag,
            workers=self.workers,
            hot_keys=hot if hot is not None else np.zeros(0, np.int64),
        )
        need = required_capacity(base, batches)
        config = PlannerConfig(
            num_trainers=self.trainers,
            lookahead=self.lookahead,
            prefetch_lead=self.lead,
            capacity=need + self.slack,
            mode=self.mode,  # type: ignore[arg-type]
            checkpoint_every=self.checkpoint_every,
            total_rows=total,
            write_lag=self.write_lag,
            workers=self.workers,
            hot_keys=base.hot_keys,
        )
        return config, batches


def plan_incrementally(config: PlannerConfig, batches: list[np.ndarray]) -> list[list[Directive]]:
    """The production planner fed one batch at a time, then finished; with P > 1 workers,
    in this process (`in_process_planner`)."""
    planner = Planner(config) if config.workers == 1 else in_process_planner(config)
    out: list[list[Directive]] = []
    for b in batches:
        out.extend(planner.push(b))
    out.extend(planner.finish())
    return out


def in_process_planner(config: PlannerConfig) -> ParallelPlanner:
    """The planner of P > 1 workers with the workers' planners in this process: what
    `Planner` runs in worker processes, with the same merge and pipelining, in milliseconds
    rather than a process start per planner."""
    return ParallelPlanner(config, InProcessPool(config), PlannerStats(num_trainers=config.num_trainers))


def wire(directives: list[list[Directive]]) -> list[list[bytes]]:
    return [[d.to_wire() for d in per_trainer] for per_trainer in directives]
