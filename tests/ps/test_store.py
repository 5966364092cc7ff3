from __future__ import annotations

import signal
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from common.errors import BadRequest, ConfigError, Conflict, NotFound
from common.init import initial_rows
from common.keys import TableLayout
from ps.checkpoint import list_checkpoints, load_snapshot, remove_leftovers, save_snapshot
from ps.store import DEFAULT_VERSION_LIMIT, ShardConfig, ShardStore
from tests.ps.conftest import raw_state, same_state

LAYOUT = TableLayout((50, 30))


def make_store(shard: int = 1, num_shards: int = 3, state_width: int = 1) -> ShardStore:
    cfg = ShardConfig(
        shard=shard, num_shards=num_shards, layout=LAYOUT, dim=4, state_width=state_width,
        state_init=0.5, seed=7,
    )
    return ShardStore(cfg)


def test_first_read_is_the_initial_value_for_any_shard_count() -> None:
    keys = np.array([1, 4, 76])
    for num_shards in (1, 3):
        store = make_store(shard=1 % num_shards, num_shards=num_shards)
        rows, state, versions = store.gather(store.check_keys(keys))
        assert np.array_equal(rows, initial_rows(LAYOUT, 7, keys, 4))
        assert (state == 0.5).all() and (versions == -1).all()


def test_a_first_read_that_names_a_row_twice_gives_its_initial_value_twice() -> None:
    store = make_store()
    keys = np.array([4, 76, 4, 4])
    rows, state, versions = store.gather(store.check_keys(keys))
    assert np.array_equal(rows, initial_rows(LAYOUT, 7, keys, 4))
    assert (state == 0.5).all() and (versions == -1).all()


def test_write_back_then_gather_returns_it() -> None:
    store = make_store()
    keys = np.array([4, 7])
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    state = np.array([[1.0], [2.0]], np.float32)
    local = store.check_write(keys, rows, state, version=3)
    store.write_back(local, rows, state, 3)
    got_rows, got_state, got_versions = store.gather(store.check_keys(np.array([7, 4, 10])))
    assert np.array_equal(got_rows[:2], rows[::-1])
    assert np.array_equal(got_state[:2], state[::-1])
    assert got_versions.tolist() == [3, 3, -1]
    assert np.array_equal(got_rows[2], initial_rows(LAYOUT, 7, np.array([10]), 4)[0])


def test_ready_compares_versions() -> None:
    store = make_store()
    local = store.check_keys(np.array([4, 7]))
    assert store.ready(local, np.array([-1, -1]))
    assert not store.ready(local, np.array([0, -1]))
    store.write_back(local[:1], np.zeros((1, 4), np.float32), np.zeros((1, 1), np.float32), 0)
    assert store.ready(local, np.array([0, -1]))


@pytest.mark.parametrize(
    ("keys", "rows_shape", "state_shape", "version", "error", "message"),
    [
        ([4, 200], (2, 4), (2, 1), 1, BadRequest, "outside"),
        ([4, 5], (2, 4), (2, 1), 1, BadRequest, "belongs to shard 2"),
        ([4], (1, 3), (1, 1), 1, BadRequest, "rows must have shape"),
        ([4], (1, 4), (1, 2), 1, BadRequest, "state must have shape"),
        ([4, 4], (2, 4), (2, 1), 1, BadRequest, "same key twice"),
        ([4], (1, 4), (1, 1), -2, BadRequest, "version must be"),
        ([4], (1, 4), (1, 1), 5, Conflict, "not newer"),
    ],
)
def test_bad_write_backs_change_nothing(keys, rows_shape, state_shape, version, error, message) -> None:
    store = make_store()
    good = store.check_keys(np.array([4]))
    store.write_back(good, np.ones((1, 4), np.float32), np.ones((1, 1), np.float32), 5)
    before = store.snapshot()
    with pytest.raises(error, match=message):
        store.check_write(
            np.array(keys), np.zeros(rows_shape, np.float32), np.zeros(state_shape, np.float32), version
        )
    after = store.snapshot()
    for name in ("local", "rows", "state", "versions"):
        assert np.array_equal(getattr(before, name), getattr(after, name))


def test_non_finite_rows_are_refused() -> None:
    store = make_store()
    rows = np.full((1, 4), np.nan, np.float32)
    with pytest.raises(BadRequest, match="finite"):
        store.check_write(np.array([4]), rows, np.zeros((1, 1), np.float32), 0)


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    store = make_store()
    local = store.check_keys(np.array([4, 7, 13]))
    store.gather(local[:1])  # touched by a read only
    store.write_back(local[1:], np.full((2, 4), 3.0, np.float32), np.full((2, 1), 9.0, np.float32), 2)
    path, nbytes = save_snapshot(tmp_path, 2, store.snapshot(), {"shard": 1})
    assert path.name == "ckpt-0000000002" and nbytes > 0
    expected = store.gather(store.check_keys(np.array([4, 7, 13, 10])))

    store.write_back(local, np.zeros((3, 4), np.float32), np.zeros((3, 1), np.float32), 9)
    snap, meta = load_snapshot(tmp_path, 2)
    assert meta["shard"] == 1 and meta["checkpoint"] == 2
    store.restore(snap)
    got = store.gather(store.check_keys(np.array([4, 7, 13, 10])))
    for want, have in zip(expected, got):
        assert np.array_equal(want, have)


def test_incomplete_checkpoints_are_ignored(tmp_path: Path) -> None:
    store = make_store()
    save_snapshot(tmp_path, 1, store.snapshot(), {})
    (tmp_path / ".tmp-ckpt-0000000002").mkdir()  # a crash mid-save
    (tmp_path / "ckpt-0000000003").mkdir()  # renamed dir without meta can't exist, but be safe
    assert list_checkpoints(tmp_path) == [1]
    with pytest.raises(NotFound):
        load_snapshot(tmp_path, 3)
    save_snapshot(tmp_path, 4, store.snapshot(), {})
    assert list_checkpoints(tmp_path) == [1, 4]
    remove_leftovers(tmp_path)  # at a process's start
    assert not (tmp_path / ".tmp-ckpt-0000000002").exists()
    assert list_checkpoints(tmp_path) == [1, 4]


def test_a_snapshot_being_written_survives_the_next_checkpoints_save(tmp_path: Path) -> None:
    """Reports come off the critical path: checkpoint c + every may be saved while c is."""
    store = make_store()
    (tmp_path / ".tmp-ckpt-0000000002").mkdir()  # checkpoint 2, half written
    (tmp_path / ".tmp-ckpt-0000000002" / "rows.npy").write_bytes(b"in progress")
    save_snapshot(tmp_path, 7, store.snapshot(), {})
    assert (tmp_path / ".tmp-ckpt-0000000002" / "rows.npy").read_bytes() == b"in progress"


def test_restore_refuses_a_snapshot_of_another_shape() -> None:
    small = make_store(state_width=1)
    small.gather(small.check_keys(np.array([4])))
    other = make_store(state_width=0)
    with pytest.raises(BadRequest, match="state"):
        other.restore(small.snapshot())


def checkpointing_store(every: int = 5) -> ShardStore:
    cfg = ShardConfig(shard=0, num_shards=1, layout=LAYOUT, dim=4, state_width=1, seed=7, checkpoint_every=every)
    return ShardStore(cfg)


def put(store: ShardStore, keys: list[int], value: float, version: int, *, flush: bool = False, replay: bool = False) -> None:
    k = np.array(keys, dtype=np.int64)
    rows, state = np.full((len(k), 4), value, np.float32), np.full((len(k), 1), value, np.float32)
    local = store.check_write(k, rows, state, version, flush=flush, replay=replay)
    store.write_back(local, rows, state, version, flush=flush, replay=replay)


def values(snap, keys: list[int]) -> list[float]:
    pos = {int(i): n for n, i in enumerate(snap.local)}
    return [float(snap.rows[pos[k], 0]) if k in pos else None for k in keys]


def test_a_write_past_a_pending_checkpoint_keeps_the_old_value_for_it() -> None:
    store = checkpointing_store()
    put(store, [1, 2], 1.0, version=3)  # before checkpoint 4
    put(store, [1], 2.0, version=6)  # crosses 4: the snapshot of 4 needs the 1.0
    put(store, [7], 3.0, version=8)  # untouched before: not part of checkpoint 4 at all
    snap = store.snapshot(4)
    assert values(snap, [1, 2, 7]) == [1.0, 1.0, None]
    assert store.last_checkpoint == 4
    assert values(store.snapshot(), [1, 7]) == [2.0, 3.0]  # the live rows moved on


def test_a_checkpoint_copies_its_rows_once() -> None:
    """A snapshot's transient memory is one copy of the rows it holds, plus indices: the rows
    go straight from the table into it and the saved ones over them (docs/design.md#checkpoints).
    Before, the table's rows were copied, concatenated with the saved ones and picked: three
    copies beside the table, for the length of every checkpoint."""
    n, dim = 200_000, 16
    store = ShardStore(ShardConfig(shard=0, num_shards=1, layout=TableLayout((n,)), dim=dim, state_width=1,
                                   checkpoint_every=10))
    keys = np.arange(n, dtype=np.int64)
    store.write_back(keys, np.ones((n, dim), np.float32), np.ones((n, 1), np.float32), 9)
    hot = keys[::50]  # written past checkpoint 10 before it is taken: their saved values belong to it
    store.write_back(hot, np.full((len(hot), dim), 2.0, np.float32), np.ones((len(hot), 1), np.float32), 11)
    tracemalloc.start()
    try:
        snap = store.snapshot(10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    held = sum(a.nbytes for a in (snap.local, snap.rows, snap.state, snap.versions))
    assert np.array_equal(snap.local, keys) and (snap.rows == 1.0).all() and (snap.versions == 9).all()
    assert peak < 1.5 * held, f"a snapshot of {held:,} bytes peaked at {peak:,}"


def test_a_flush_that_lands_after_a_newer_write_goes_only_to_its_checkpoint() -> None:
    store = checkpointing_store()
    put(store, [1], 1.0, version=2)
    put(store, [1], 5.0, version=6)  # another trainer's eviction arrived first
    put(store, [1], 4.0, version=4, flush=True)  # the value at 4
    put(store, [3], 9.0, version=4, flush=True)  # an ordinary flush
    assert values(store.snapshot(4), [1, 3]) == [4.0, 9.0]
    assert values(store.snapshot(), [1, 3]) == [5.0, 9.0]


def test_flush_versions_must_be_pending_checkpoints() -> None:
    store = checkpointing_store()
    put(store, [1], 1.0, version=4, flush=True)
    with pytest.raises(BadRequest, match="not a checkpoint iteration"):
        put(store, [2], 1.0, version=5, flush=True)
    with pytest.raises(Conflict, match="not newer"):
        put(store, [1], 2.0, version=4, flush=True)  # a replay
    store.snapshot(4)
    with pytest.raises(BadRequest, match="not a pending checkpoint"):
        put(store, [2], 1.0, version=4, flush=True)  # already taken


def test_restore_sets_the_checkpoint_and_drops_saved_rows() -> None:
    store = checkpointing_store()
    put(store, [1], 1.0, version=3)
    snap = store.snapshot(4)
    put(store, [1], 2.0, version=11)  # saved for 9
    store.restore(snap, 4)
    assert store.last_checkpoint == 4 and values(store.snapshot(9), [1]) == [1.0]
    assert store.rows_held == 1


def test_a_replayed_write_that_landed_already_changes_nothing() -> None:
    store = checkpointing_store()
    put(store, [1, 2], 1.0, version=3)
    put(store, [1, 2], 1.0, version=3, replay=True)  # retried after a broken connection
    put(store, [2], 2.0, version=6)
    put(store, [2], 1.0, version=3, replay=True)  # ... or after a newer write of the row
    assert values(store.snapshot(), [1, 2]) == [1.0, 2.0]
    assert values(store.snapshot(4), [1, 2]) == [1.0, 1.0]


def test_a_replayed_write_older_than_the_table_still_reaches_its_checkpoint() -> None:
    store = checkpointing_store()
    put(store, [1], 5.0, version=11, replay=True)  # another trainer's newer write came first
    put(store, [1], 3.0, version=7, replay=True)  # the value checkpoint 9 must hold
    put(store, [1], 2.0, version=2, replay=True)  # the value of checkpoint 4
    put(store, [1], 4.0, version=9, flush=True, replay=True)
    put(store, [1], 4.0, version=9, flush=True, replay=True)  # twice
    assert values(store.snapshot(4), [1]) == [2.0]
    assert values(store.snapshot(9), [1]) == [4.0]
    assert values(store.snapshot(), [1]) == [5.0]
    put(store, [1], 4.0, version=9, flush=True, replay=True)  # its checkpoint is taken: ignored
    assert values(store.snapshot(), [1]) == [5.0]


def test_a_replayed_flush_must_still_be_a_checkpoint_iteration() -> None:
    with pytest.raises(BadRequest, match="not a checkpoint iteration"):
        put(checkpointing_store(), [1], 1.0, version=5, flush=True, replay=True)


@dataclass(frozen=True)
class Write:
    version: int
    keys: tuple[int, ...]
    value: float
    flush: bool


def trainers_writes(rng: np.random.Generator, every: int, iterations: int) -> list[Write]:
    """Write-backs in an order the PS can meet: by version, except that a checkpoint's flush
    may land after writes of the next iterations (it comes from another trainer). A row has
    one writer per version: its eviction or its flush."""
    writes: list[tuple[float, Write]] = []
    for v in range(iterations):
        free = list(rng.permutation(12))
        for _ in range(rng.integers(0, 3)):
            keys, free = free[: rng.integers(1, 5)], free[4:]
            if keys:
                writes.append((v, Write(v, tuple(int(k) for k in keys), float(rng.normal()), False)))
        if (v + 1) % every == 0 and free:
            keys = free[: rng.integers(1, 6)]
            late = rng.uniform(0, every - 1)  # lands before the next checkpoint's flushes
            writes.append((v + late + 0.5, Write(v, tuple(int(k) for k in keys), float(rng.normal()), True)))
    return [w for _, w in sorted(writes, key=lambda t: t[0])]


def apply_in_order(writes: list[Write], every: int) -> tuple[list[Write], dict[int, object], object]:
    """Apply `writes` strictly, dropping what the PS refuses (two trainers cannot both have
    written a row at one version); snapshot each checkpoint once all its writes are in."""
    store = checkpointing_store(every)
    accepted, snaps = [], {}
    for w in writes:
        try:
            put(store, list(w.keys), w.value, w.version, flush=w.flush)
        except Conflict:
            continue
        accepted.append(w)
        if w.flush:
            snaps[w.version] = store.snapshot(w.version)
    return accepted, snaps, store.snapshot()


def same_rows(a, b) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("local", "rows", "state", "versions"))


@pytest.mark.parametrize("seed", range(200))
def test_restore_and_replay_in_any_order_equals_the_uninterrupted_shard(seed: int) -> None:
    """A shard restarted alone from its snapshot of c, given every write since c again in
    any order (some twice), holds the same rows and takes the same later checkpoints."""
    rng = np.random.default_rng(seed)
    every = int(rng.integers(2, 5))
    writes, snaps, final = apply_in_order(trainers_writes(rng, every, 6 * every), every)
    c = int(rng.choice(sorted(snaps))) if snaps and rng.random() < 0.8 else -1
    store = checkpointing_store(every)
    if c >= 0:
        store.restore(snaps[c], c)
    since = [w for w in writes if w.version > c]
    replay = [since[i] for i in rng.permutation(len(since))]
    replay += [replay[i] for i in rng.choice(len(replay), size=len(replay) // 4)] if replay else []
    for w in replay:
        put(store, list(w.keys), w.value, w.version, flush=w.flush, replay=True)
    for later in sorted(k for k in snaps if k > c):
        assert same_rows(store.snapshot(later), snaps[later]), f"checkpoint {later} differs"
    assert same_rows(store.snapshot(), final)


@pytest.mark.parametrize("version", [101, 2**62, 2**63, 2**64 - 1, -(2**63)])
@pytest.mark.parametrize(("flush", "replay"), [(False, False), (True, False), (False, True)])
def test_a_version_the_run_cannot_produce_is_refused_and_changes_nothing(version: int, flush: bool, replay: bool) -> None:
    cfg = ShardConfig(shard=0, num_shards=1, layout=LAYOUT, dim=4, state_width=1, checkpoint_every=1, version_limit=100)
    store = ShardStore(cfg)
    put(store, [1, 2], 1.0, version=7)
    before = raw_state(store)
    with pytest.raises(BadRequest, match=r"version must be an integer in 0\.\.100"):
        put(store, [1, 2], 2.0, version=version, flush=flush, replay=replay)
    assert same_state(before, raw_state(store))


def test_an_unchecked_write_that_cannot_be_stored_changes_nothing() -> None:
    """`write_back` computes all it can fail on before its first assignment."""
    store = checkpointing_store()
    put(store, [1], 1.0, version=7)
    before = raw_state(store)
    with pytest.raises(OverflowError):
        store.write_back(store.check_keys(np.array([1])), np.zeros((1, 4), np.float32), np.zeros((1, 1), np.float32), 2**63)
    assert same_state(before, raw_state(store))


class _Deadline(Exception):
    pass


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail the block if it runs past `seconds` (a pure-Python loop is interrupted)."""

    def expire(signum: int, frame: object) -> None:
        raise _Deadline(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_version_jump_costs_what_a_near_version_does() -> None:
    """A write far past the last checkpoint keeps one copy for all the checkpoints it
    crosses, instead of walking them (2**40 of them here: it never finished)."""
    store = checkpointing_store(every=1)
    put(store, [1, 2], 1.0, version=3)
    with deadline(2.0):
        put(store, [1], 2.0, version=DEFAULT_VERSION_LIMIT)
        put(store, [2], 4.0, version=DEFAULT_VERSION_LIMIT // 2, flush=True, replay=True)
        put(store, [2], 3.0, version=DEFAULT_VERSION_LIMIT)
        put(store, [2], 5.0, version=DEFAULT_VERSION_LIMIT - 2, flush=True, replay=True)
    assert len(store._saved) == 4
    assert values(store.snapshot(3), [1, 2]) == [1.0, 1.0]
    assert values(store.snapshot(DEFAULT_VERSION_LIMIT // 2 + 1), [1, 2]) == [1.0, 4.0]
    assert values(store.snapshot(DEFAULT_VERSION_LIMIT - 1), [1, 2]) == [1.0, 5.0]
    assert not store._saved  # no checkpoint left needs a saved row
    assert values(store.snapshot(), [1, 2]) == [2.0, 3.0]


def test_an_accumulator_below_its_floor_is_refused_and_nothing_changes() -> None:
    """Row-wise Adagrad's state is a sum of squares: a write-back of -5 was stored, and the
    trainer's sqrt of it then gave NaN."""
    cfg = ShardConfig(shard=0, num_shards=1, layout=LAYOUT, dim=4, state_width=1, state_init=0.5,
                      state_min=0.0)
    store = ShardStore(cfg)
    keys = np.array([1, 4])
    rows = np.ones((2, 4), np.float32)
    for bad in (-5.0, -1e-30):
        state = np.array([[1.0], [bad]], np.float32)
        with pytest.raises(BadRequest, match="state must be >= 0") as refused:
            store.check_write(keys, rows, state, 3)
        assert refused.value.fields["field"] == "state"
    local = store.check_write(keys, rows, np.zeros((2, 1), np.float32), 3)  # 0 itself is fine
    assert store.write_back(local, rows, np.zeros((2, 1), np.float32), 3) == 2
    with pytest.raises(ConfigError, match="state_init"):
        ShardConfig(shard=0, num_shards=1, layout=LAYOUT, dim=4, state_width=1, state_init=-1.0, state_min=0.0)


def test_the_ps_takes_its_state_floor_from_the_optimizer() -> None:
    from common.optimizer_spec import OptimizerSpec

    assert OptimizerSpec(embedding="rowwise_adagrad").state_min == 0.0
    assert OptimizerSpec(embedding="sgd").state_min is None
