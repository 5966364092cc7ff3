"""Replays directives against simulated trainers, PS and network, with real values (DESIGN §11).

Each trainer has a cache of C slots holding (key, value[2], adagrad state) in float64. A
pseudo-gradient depends on (iteration, trainer, key) and on the value read, so a stale read
changes every later value. A single-process reference applies the same updates to a full table.
Trainers follow "The boundary into x" of DESIGN §4 step by step, in lockstep (their collectives
make them so); the PS and network are asynchronous: write-backs arrive in a random order at
random times, fetches are served at random times once the PS version reaches their
`min_version`. A trainer waiting for a fetch lets the network deliver what is in flight; if
the write-back it needs has not been sent, that is a deadlock.

`simulate` raises `SimulationError` at the first broken invariant of §4:
reads see every earlier update (value and state, bit for bit); slots stay in [0, C) and are
never written while occupied; exactly one write-back per residency end (checkpoint flushes
aside), each carrying the reference value of its version; a fetch gets exactly the version it
asked for and never deadlocks; join and sync key lists are identical across trainers; each
checkpoint's PS view equals the reference; the final PS table equals the reference.

With `config.first_iteration` = F > 0 (a run resumed from checkpoint F-1) iterations are
numbered from F and the PS starts with each key at a random version in [-1, F-1]: a fetch
with min_version -1 must then get that pre-resume version, any other exactly its own.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from common.directive import Directive
from oracle.planner import Planner
from oracle.config import PlannerConfig, required_capacity

LR = 0.1


class SimulationError(AssertionError):
    """A directive stream broke an invariant of DESIGN §4."""


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
    staged: dict[tuple[int, int], tuple[int, Row]] = field(default_factory=dict)  # (target, slot)
    held: list[tuple[int, int, Row]] = field(default_factory=list)  # key, version, row (x-1)
    grads: dict[int, tuple[float, float]] = field(default_factory=dict)


@dataclass
class _Fetch:
    trainer: int
    key: int
    slot: int
    min_version: int
    target: int
    row: Row | None = None


class Simulation:
    """One replay; see `simulate`."""

    def __init__(self, config: PlannerConfig, batches: list[np.ndarray], seed: int) -> None:
        self.cfg = config
        self.T = config.num_trainers
        self.first = config.first_iteration
        self.batches = batches  # batch i is iteration first + i
        self.rng = random.Random(seed)
        self.local = config.mode == "local"
        self.ref: dict[int, Row] = {}
        self.ref_history: dict[int, list[tuple[int, Row]]] = {}
        self.ps: dict[int, tuple[int, Row]] = {}  # key -> version, row
        self.ps_writes: dict[int, list[tuple[int, Row]]] = {}
        self.in_flight: list[tuple[int, int, Row]] = []  # key, version, row
        self.fetches: list[_Fetch] = []
        self.trainers = [_Trainer() for _ in range(self.T)]
        self.later: dict[int, dict[int, tuple[float, float]]] = {}  # x -> key -> reduced grad
        self.sent: dict[int, dict[int, int]] = {}  # version -> key -> write count
        self.resident: dict[int, set[int]] = {}
        self.resumed: dict[int, int] = self.resumed_versions()  # key -> version before F
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

    def send(self, key: int, version: int, row: Row) -> None:
        if row != self.ref_at(key, version):
            self.fail(f"write-back of key {key} version {version} carries a stale row")
        self.in_flight.append((key, version, row))

    def deliver(self, item: tuple[int, int, Row]) -> None:
        key, version, row = item
        self.ps_writes.setdefault(key, []).append((version, row))
        stored = self.ps.get(key, (-1, initial_row(key)))[0]
        if version == stored:
            self.fail(f"two write-backs of key {key} with version {version}")
        if version > stored:
            self.ps[key] = (version, row)

    def network(self) -> None:
        """Random progress: some write-backs land, some eligible fetches are served."""
        self.rng.shuffle(self.in_flight)
        keep = []
        for item in self.in_flight:
            (self.deliver if self.rng.random() < 0.5 else keep.append)(item)
        self.in_flight = keep
        for f in self.fetches:
            if f.row is None and self.rng.random() < 0.5:
                self.serve(f)

    def serve(self, f: _Fetch) -> bool:
        version, row = self.ps.get(f.key, (-1, initial_row(f.key)))
        if version < f.min_version:
            return False
        wanted = f.min_version if f.min_version >= 0 else self.resumed.get(f.key, -1)
        if version != wanted:
            self.fail(f"fetch of key {f.key} asked version {f.min_version}, PS has {version}")
        f.row = row
        return True

    def wait(self, f: _Fetch) -> None:
        """The trainer blocks: in-flight write-backs land (random order) until f is served."""
        self.rng.shuffle(self.in_flight)
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
        for x in range(first, first + n):
            ds = directives[x - first]
            self.check_lists(x, ds)
            self.boundary(x, directives)
            self.network()
            self.step(x, ds)
            self.network()
            self.resident[x] = self.keys_resident()
        self.boundary(first + n, directives)
        self.boundary(first + n + 1, directives)
        while self.in_flight:
            self.deliver(self.in_flight.pop())
        self.final_checks(n)

    def check_lists(self, x: int, ds: list[Directive]) -> None:
        for name in ("join_keys", "sync_now_keys", "sync_later_keys"):
            if any(not np.array_equal(getattr(d, name), getattr(ds[0], name)) for d in ds):
                self.fail(f"{name} of iteration {x} differ across trainers")
        if any(d.iteration != x or d.trainer != j for j, d in enumerate(ds)):
            self.fail(f"directives of iteration {x} are mislabelled")

    def boundary(self, x: int, directives: list[list[Directive]]) -> None:
        n, i = len(directives), x - self.first  # directives[i] is iteration x
        cur = directives[i] if i < n else None
        prev = directives[i - 1] if 0 < i <= n else None
        prev2 = directives[i - 2] if 1 < i <= n + 1 else None
        if cur is not None:  # 0. issue prefetches
            for j, d in enumerate(cur):
                for k, s, v, tg in zip(d.prefetch_keys, d.prefetch_slots, d.prefetch_min_versions, d.prefetch_targets):
                    self.fetches.append(_Fetch(j, int(k), int(s), int(v), int(tg)))
        if prev2 is not None:  # 1. sync_later(x-2) to staying copies and held rows
            self.apply_later(x - 2, prev2)
        sources = self.read_join_sources(cur) if cur is not None else {}  # 2.
        if prev is not None:  # 3. leave after x-1
            self.leave(x - 1, prev)
        if cur is not None:  # 4. joins
            self.write_joins(cur, sources)
        if prev is not None and not self.local:
            self.check_residency_ends(x - 1)
        if cur is not None:  # 5. fetches targeting x
            self.insert_fetches(x)

    def apply_later(self, e: int, ds: list[Directive]) -> None:
        reduced = self.later.pop(e, {})
        for j, d in enumerate(ds):
            t = self.trainers[j]
            left = set(int(s) for s in d.leave_slots)
            for k, s in zip(d.sync_later_keys, d.sync_later_slots):
                k, s = int(k), int(s)
                if s >= 0 and s not in left:
                    row = self.read_slot(j, s, k, f"sync_later({e})")
                    t.cache[s] = (k, apply(row, reduced[k]))
            for key, version, row in t.held:
                self.send(key, version, apply(row, reduced[key]))
            t.held = []

    def read_join_sources(self, ds: list[Directive]) -> dict[int, tuple[int, Row]]:
        sources: dict[int, tuple[int, Row]] = {}
        for j, d in enumerate(ds):
            for k, s in zip(d.join_keys, d.join_send_slots):
                if s >= 0:
                    if int(k) in sources:
                        self.fail(f"two join sources for key {int(k)}")
                    sources[int(k)] = (j, self.read_slot(j, int(s), int(k), "join source"))
        return sources

    def leave(self, e: int, ds: list[Directive]) -> None:
        for j, d in enumerate(ds):
            t = self.trainers[j]
            later = set(int(k) for k in d.sync_later_keys)
            for k, s, v in zip(d.write_keys, d.write_slots, d.write_versions):
                key = int(k)
                row = self.read_slot(j, int(s), key, f"write-back after {e}")
                self.sent.setdefault(e, {}).setdefault(key, 0)
                self.sent[e][key] += 1
                if key in later:
                    t.held.append((key, int(v), row))
                else:
                    self.send(key, int(v), row)
            for s in d.leave_slots:
                if int(s) not in t.cache:
                    self.fail(f"trainer {j} frees empty slot {int(s)} after {e}")
                del t.cache[int(s)]

    def write_joins(self, ds: list[Directive], sources: dict[int, tuple[int, Row]]) -> None:
        for j, d in enumerate(ds):
            for k, s in zip(d.join_keys, d.join_recv_slots):
                if s >= 0:
                    if int(k) not in sources:
                        self.fail(f"trainer {j} joins key {int(k)} that nobody sends")
                    self.write_slot(self.trainers[j], j, int(s), int(k), sources[int(k)][1])

    def insert_fetches(self, x: int) -> None:
        due = [f for f in self.fetches if f.target == x]
        self.fetches = [f for f in self.fetches if f.target != x]
        for f in due:
            self.wait(f)
            assert f.row is not None
            self.write_slot(self.trainers[f.trainer], f.trainer, f.slot, f.key, f.row)

    def check_residency_ends(self, e: int) -> None:
        """Keys resident during e and gone now ended after e: one write-back of version e."""
        ended = self.resident.get(e, set()) - self.keys_resident()
        written = self.sent.get(e, {})
        for key in ended:
            if written.get(key, 0) != 1:
                self.fail(f"residency of key {key} ended after {e} with {written.get(key, 0)} write-backs")
        for key, count in written.items():
            if key not in ended and not (self.cfg.is_checkpoint(e) and count == 1):
                self.fail(f"key {key} written {count} times with version {e} but its residency goes on")

    def keys_resident(self) -> set[int]:
        return {key for t in self.trainers for key, _ in t.cache.values()}

    # ----------------------------------------------------------------- forward, sync
    def step(self, x: int, ds: list[Directive]) -> None:
        batch = self.batches[x - self.first]
        per = batch.shape[0] // self.T
        users: dict[int, list[tuple[float, float] | None]] = {}
        for j, d in enumerate(ds):
            t = self.trainers[j]
            t.grads = {}
            part = batch[j * per : (j + 1) * per]
            if d.input_slots.shape != part.shape:
                self.fail(f"input_slots of trainer {j} at {x} have shape {d.input_slots.shape}")
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
        self.sync(x, ds, users)

    def reference_step(self, x: int, users: dict[int, list[tuple[float, float] | None]]) -> None:
        for key in sorted(users):
            row = apply(self.ref_row(key), reduce(users[key], self.T))
            self.ref[key] = row
            self.ref_history.setdefault(key, []).append((x, row))

    def sync(self, x: int, ds: list[Directive], users: dict[int, list[tuple[float, float] | None]]) -> None:
        now = [int(k) for k in ds[0].sync_now_keys]
        later = [int(k) for k in ds[0].sync_later_keys]
        listed = set(now) | set(later)
        if not listed <= set(users):
            self.fail(f"sync lists of {x} name keys nobody used")
        for j, d in enumerate(ds):
            t = self.trainers[j]
            for k, s in zip(now, d.sync_now_slots):
                if s >= 0:
                    row = self.read_slot(j, int(s), k, f"sync_now({x})")
                    t.cache[int(s)] = (k, apply(row, reduce(users[k], self.T)))
            slot_of = {key: s for s, (key, _) in t.cache.items()}
            for key, g in t.grads.items():
                if key not in listed:
                    s = slot_of[key]
                    t.cache[s] = (key, apply(t.cache[s][1], (g[0] / self.T, g[1] / self.T)))
        self.later[x] = {k: reduce(users[k], self.T) for k in later}

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


def simulate(config: PlannerConfig, batches: list[np.ndarray], directives: list[list[Directive]], seed: int = 0) -> None:
    """Replay `directives` (per iteration, per trainer) for `batches`; SimulationError if any
    invariant of DESIGN §4 breaks."""
    Simulation(config, [np.asarray(b, dtype=np.int64) for b in batches], seed).run(directives)


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

    def batches(self) -> list[np.ndarray]:
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
            hot_keys=base.hot_keys,
        )
        return config, batches


def plan_incrementally(config: PlannerConfig, batches: list[np.ndarray]) -> list[list[Directive]]:
    """The production planner fed one batch at a time, then finished."""
    planner = Planner(config)
    out: list[list[Directive]] = []
    for b in batches:
        out.extend(planner.push(b))
    out.extend(planner.finish())
    return out


def wire(directives: list[list[Directive]]) -> list[list[bytes]]:
    return [[d.to_wire() for d in per_trainer] for per_trainer in directives]
