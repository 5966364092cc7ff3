"""ShardStore against a model, over generated request sequences: a refused request leaves
the shard byte-identical (rows, state, versions, saved checkpoint rows, counters), and an
accepted one does what the model says.

The model keeps, per row, every value ever accepted with its version; the table holds the
newest, and checkpoint c holds the newest at or below c (docs/design.md#version-rules, #checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from common.checkpoints import first_checkpoint_from, is_checkpoint
from common.errors import BagpipeError
from common.init import initial_rows
from common.keys import TableLayout
from ps.store import ShardConfig, ShardStore, Snapshot
from tests.ps.conftest import raw_state, same_state

LAYOUT = TableLayout((50, 30))
SHARDS, SHARD, DIM, LIMIT, SEED, STATE_INIT = 2, 0, 3, 40, 5, 0.25
#: Versions a request may carry: the run's own, one past either end, and what overflows.
EXTREME = [-1, LIMIT + 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**64)]
#: Mostly valid values, so that accepted requests build up state for refused ones to spoil.
VERSIONS = st.integers(0, 9).flatmap(lambda n: st.sampled_from(EXTREME) if n == 0 else st.integers(0, LIMIT))
#: Keys on this shard, mostly; on the other shard, and out of range.
KEYS = st.integers(0, 19).flatmap(
    lambda n: st.sampled_from([1, 3, 79, -1, 80, 2**40]) if n == 0 else st.sampled_from(range(0, 80, 2))
)


@dataclass(frozen=True)
class Write:
    keys: tuple[int, ...]
    version: int
    flush: bool
    replay: bool
    value: float  # row i holds value + i; NaN: a refused, non-finite write
    width: int  # DIM, or a wrong row width


@dataclass(frozen=True)
class Gather:
    keys: tuple[int, ...]


@dataclass(frozen=True)
class Snap:
    ahead: int  # checkpoint first_checkpoint_from(last_checkpoint + 1 + ahead)


Op = Write | Gather | Snap

OPS = st.one_of(
    st.builds(
        Write,
        keys=st.lists(KEYS, min_size=0, max_size=5).map(tuple),
        version=VERSIONS,
        flush=st.booleans(),
        replay=st.booleans(),
        value=st.sampled_from([float(v) for v in range(-9, 10)] + [float("nan")]),
        width=st.sampled_from([DIM] * 9 + [DIM + 1]),
    ),
    st.builds(Gather, keys=st.lists(st.sampled_from(range(0, 80, 2)), max_size=4).map(tuple)),
    st.builds(Snap, ahead=st.integers(0, 12)),
)


@dataclass
class Model:
    every: int
    #: Per local row, each accepted (version, row + state), in arrival order.
    history: dict[int, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    last_checkpoint: int = -1

    def stored(self, local: int) -> int:
        return self.newest(local, None)[0] if local in self.history else -1

    def newest(self, local: int, at_most: int | None) -> tuple[int, np.ndarray]:
        """The value with the highest version (<= `at_most`), the later one on a tie."""
        entries = [e for e in self.history.get(local, []) if at_most is None or e[0] <= at_most]
        best = max(e[0] for e in entries)
        return [e for e in entries if e[0] == best][-1]

    def accepts(self, w: Write, keys: np.ndarray) -> bool:
        valid_keys = all(0 <= k < LAYOUT.total_rows and k % SHARDS == SHARD for k in w.keys)
        finite = not (w.keys and np.isnan(w.value))
        if not (valid_keys and finite) or len(set(w.keys)) != len(w.keys) or w.width != DIM:
            return False
        if not 0 <= w.version <= LIMIT or (w.flush and not is_checkpoint(w.version, self.every)):
            return False
        if w.replay:
            return True
        stored = [self.stored(k // SHARDS) for k in w.keys]
        if w.flush:
            return w.version > self.last_checkpoint and w.version not in stored
        return all(s < w.version for s in stored)

    def write(self, w: Write, values: np.ndarray) -> int:
        written = 0
        for k, row in zip(w.keys, values):
            local, stored = k // SHARDS, self.stored(k // SHARDS)
            if stored != w.version:  # the same version again is a replay that landed already
                self.history.setdefault(local, []).append((w.version, row))
                written += stored < w.version
        return written

    def gather(self, keys: np.ndarray) -> None:
        for k in keys:
            if int(k) // SHARDS not in self.history:
                init = np.concatenate([initial_rows(LAYOUT, SEED, np.array([k]), DIM)[0], [STATE_INIT]])
                self.history[int(k) // SHARDS] = [(-1, init.astype(np.float32))]

    def snapshot(self, c: int | None) -> dict[int, tuple[int, np.ndarray]]:
        rows = {}
        for local, entries in self.history.items():
            if c is None or any(v <= c for v, _ in entries):
                rows[local] = self.newest(local, c)
        if c is not None:
            self.last_checkpoint = max(self.last_checkpoint, c)
        return rows


def rows_of(snap: Snapshot) -> dict[int, tuple[int, np.ndarray]]:
    both = np.hstack([snap.rows, snap.state])
    return {int(i): (int(v), both[n]) for n, (i, v) in enumerate(zip(snap.local, snap.versions))}


def same_rows(got: dict[int, tuple[int, np.ndarray]], want: dict[int, tuple[int, np.ndarray]]) -> bool:
    return got.keys() == want.keys() and all(
        got[i][0] == want[i][0] and np.array_equal(got[i][1], want[i][1]) for i in got
    )


def run(every: int, ops: list[Op]) -> None:
    cfg = ShardConfig(
        shard=SHARD, num_shards=SHARDS, layout=LAYOUT, dim=DIM, state_width=1, state_init=STATE_INIT,
        seed=SEED, checkpoint_every=every, version_limit=LIMIT,
    )
    store, model = ShardStore(cfg), Model(every)
    for op in ops:
        if isinstance(op, Gather):
            keys = np.array(op.keys, dtype=np.int64)
            store.gather(store.check_keys(keys))
            model.gather(keys)
        elif isinstance(op, Snap):
            c = first_checkpoint_from(model.last_checkpoint + 1 + op.ahead, every) if every else None
            assert same_rows(rows_of(store.snapshot(c)), model.snapshot(c)), f"checkpoint {c}"
            event("checkpoint taken" if c is not None else "snapshot")
        else:
            apply_write(store, model, op)
        assert same_rows(rows_of(store.snapshot()), model.snapshot(None))
        assert store.max_version == max([model.stored(i) for i in model.history], default=-1)
        assert store.rows_held == len(model.history) == np.count_nonzero(store._touched)


def apply_write(store: ShardStore, model: Model, w: Write) -> None:
    keys = np.array(w.keys, dtype=np.int64) if all(abs(k) < 2**62 for k in w.keys) else np.array([2**62])
    n = len(keys)
    values = (np.arange(n, dtype=np.float32)[:, None] + w.value) * np.ones(DIM + 1, np.float32)
    rows, state = np.ascontiguousarray(values[:, :DIM]), np.ascontiguousarray(values[:, DIM:])
    if w.width != DIM:
        rows = np.zeros((n, w.width), np.float32)
    before = raw_state(store)
    try:
        local = store.check_write(keys, rows, state, w.version, flush=w.flush, replay=w.replay)
        written = store.write_back(local, rows, state, w.version, flush=w.flush, replay=w.replay)
    except BagpipeError as exc:
        assert 400 <= exc.status < 500, exc
        assert not model.accepts(w, keys), f"refused: {exc.message}"
        assert same_state(before, raw_state(store)), "a refused write changed the shard"
        event("write refused")
        return
    assert model.accepts(w, keys), "accepted a write the model refuses"
    assert written == model.write(w, values)
    event("write accepted, some rows behind the table" if written < n else "write accepted")


CHECKPOINT_EVERY = st.sampled_from([0, 1, 3, 5])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(every=CHECKPOINT_EVERY, ops=st.lists(OPS, max_size=25))
def test_the_store_does_what_the_model_says_and_refusals_change_nothing(every: int, ops: list[Op]) -> None:
    run(every, ops)


@pytest.mark.slow
@pytest.mark.nightly
@settings(max_examples=3000, deadline=None, derandomize=True)
@given(every=CHECKPOINT_EVERY, ops=st.lists(OPS, max_size=60))
def test_the_store_does_what_the_model_says_at_length(every: int, ops: list[Op]) -> None:
    run(every, ops)
