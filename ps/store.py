"""One parameter-server shard as plain numpy: rows, row-wise optimizer state, versions.

Sans-IO: no sockets, clocks or files. The asyncio service (`ps/service.py`) validates
requests through `check_*`, waits for versions with `ready`, and calls `gather` and
`write_back`; `ps/checkpoint.py` persists `snapshot()`. Every operation either raises before
changing anything or completes: the `check_*` methods refuse what the mutating ones could
not apply whole, and those compute everything that can fail before their first assignment.
The work of a request is proportional to its number of rows, never to a number it carries
(a version far ahead costs what a near one does).

Rows are initialised lazily, on first touch, from `common.init.initial_rows`, so a shard of a
billion-row table costs only the pages it has touched (`common.arrays.lazy_zeros`: mapped
lazily, without transparent huge pages) and its values never depend on the number of shards.
The versions (8 bytes a row, -1 until written) are resident from the start.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from common.arrays import bounds, has_duplicates, in_sorted, lazy_zeros, rows_where
from common.checkpoints import first_checkpoint_from, is_checkpoint
from common.errors import BadRequest, ConfigError, Conflict, quoted
from common.init import initial_rows
from common.keys import TableLayout, global_key, local_index, shard_of, shard_size


#: The highest version a shard accepts when it is not told its run's length (tools, tests):
#: 2**40 iterations last 35 years at one per millisecond, and version arithmetic (a
#: version plus a checkpoint interval) stays far from int64's limit.
DEFAULT_VERSION_LIMIT = 1 << 40
#: The bound on `ShardConfig.version_limit` and `checkpoint_every`: their sum fits in int64.
_MAX_BOUND = 1 << 61


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    shard: int
    num_shards: int
    layout: TableLayout
    dim: int
    state_width: int
    state_init: float = 0.0
    #: The least value a row's optimizer state may hold (`OptimizerSpec.state_min`: 0 for
    #: row-wise Adagrad's accumulator); None: any finite value. A write-back below it is refused.
    state_min: float | None = None
    seed: int = 0
    checkpoint_every: int = 0  # 0: none; which iterations: common.checkpoints.is_checkpoint
    #: The highest version (iteration) and checkpoint id a request may name: what the run
    #: can produce (`ps.startup.shard_config`). A larger one is refused with 400.
    version_limit: int = DEFAULT_VERSION_LIMIT

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "version_limit"):
            value = getattr(self, name)
            if not 0 <= value <= _MAX_BOUND:
                raise ConfigError(name, f"must be in 0..{_MAX_BOUND}, got {value}")
        if self.state_min is not None and not self.state_init >= self.state_min:
            raise ConfigError("state_init", f"must be >= state_min = {self.state_min}, got {self.state_init}")


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The touched rows of a shard (copies), safe to write out while the shard keeps serving.

    Only touched rows are kept: an untouched row is its initial value by definition.
    """

    local: np.ndarray  # int64 [n] local indices
    rows: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_width]
    versions: np.ndarray  # int64 [n]


@dataclass(frozen=True, kw_only=True)
class _Saved:
    """Row values the live table does not hold that pending checkpoints need: values saved
    before a newer write replaced them, and flushes or replays that arrived after a newer
    write-back. Row i is the value of every checkpoint c with
    ``rows.versions[i] <= c < until[i]``: one copy serves any number of checkpoints."""

    rows: Snapshot
    until: np.ndarray  # int64 [n]: the newer version that replaces the row in the table


class ShardStore:
    """Rows, state and versions of one shard, plus the pending checkpoints' saved rows.

    Checkpoint c must hold every row as of iteration c, while write-backs of later
    iterations keep arriving: a write that moves a row past a pending checkpoint first
    saves the row's old value for it (copy on write), and a flush of c that arrives after a
    newer write of the same row (they come from different trainers) goes only to c (and to
    any later pending checkpoint the row has moved past). A checkpoint's row is the one with
    the highest version among what the table and the saved parts hold for it. A saved copy
    records the range of checkpoints it serves rather than being filed under each, so that a
    write jumping over many checkpoint intervals costs one copy.

    A *replayed* write-back (`replay=True`) may arrive in any order and more than once: the
    trainers resend what they wrote since this shard's snapshot after it was restarted
    alone, and a write retried after a broken connection may have landed already. Rows it
    holds that the table already has at that version or a newer one are not applied, but
    still go to the pending checkpoints they belong to; the result is the same as if every
    write had arrived once, in order.
    """

    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        n = shard_size(config.layout.total_rows, config.shard, config.num_shards)
        self.num_rows = n
        self._rows = lazy_zeros((n, config.dim), np.float32)
        self._state = lazy_zeros((n, config.state_width), np.float32)
        self._versions = np.full(n, -1, dtype=np.int64)
        self._touched = lazy_zeros((n,), np.bool_)
        self._held = 0  # rows touched: np.count_nonzero(self._touched), kept on each change
        self._saved: list[_Saved] = []
        self.last_checkpoint = -1  # the newest checkpoint taken or restored
        self.max_version = -1  # the highest version in the table, kept on each write

    @property
    def rows_held(self) -> int:
        """Rows ever touched (fetched or written): the rows a snapshot holds, and what the
        shard's memory grows with (its untouched pages are never mapped in)."""
        return self._held

    @property
    def versions(self) -> np.ndarray:
        """Every row's version (-1: never written), read-only: rows change through the store."""
        view = self._versions.view()
        view.flags.writeable = False
        return view

    # -- validation --------------------------------------------------------------------

    def check_version(self, value: object, name: str = "version") -> int:
        """`value` if it is an iteration this run can produce (0..version_limit); BadRequest
        naming `name` otherwise."""
        bound = self.config.version_limit
        if type(value) is not int or not 0 <= value <= bound:
            raise BadRequest(f"{name} must be an integer in 0..{bound}, got {quoted(value)}", field=name)
        return value

    def check_fetch(self, keys: np.ndarray, min_versions: np.ndarray) -> np.ndarray:
        """Local indices of `keys`; BadRequest for a key `check_keys` refuses or a version
        asked for that this run can never produce (it would wait for nothing)."""
        local = self.check_keys(keys)
        span = bounds(min_versions)
        if span is not None and span[1] > self.config.version_limit:
            raise BadRequest(
                f"min_versions must be at most {self.config.version_limit}, got {span[1]}",
                field="min_versions",
            )
        return local

    def check_keys(self, keys: np.ndarray) -> np.ndarray:
        """Local indices of `keys`; BadRequest for a key out of range or on another shard."""
        cfg = self.config
        cfg.layout.check_keys(keys)
        if cfg.num_shards == 1:
            return np.asarray(keys, dtype=np.int64)  # every key is ours, at its own index
        foreign = shard_of(keys, cfg.num_shards) != cfg.shard
        if foreign.any():
            bad = int(keys[foreign][0])
            raise BadRequest(
                f"key {bad} belongs to shard {bad % cfg.num_shards}, not {cfg.shard}", key=bad
            )
        return local_index(keys, cfg.num_shards)

    def check_write(
        self,
        keys: np.ndarray,
        rows: np.ndarray,
        state: np.ndarray,
        version: int,
        *,
        flush: bool = False,
        replay: bool = False,
    ) -> np.ndarray:
        """Local indices for a valid write-back; raises without changing anything otherwise.

        A flush (the checkpoint copy of a row that stays cached) must carry a pending
        checkpoint's iteration; it may be older than the stored row. A replay is not checked
        against what the table holds (see the class docstring).
        """
        cfg = self.config
        local = self.check_keys(keys)
        if rows.shape != (len(keys), cfg.dim):
            raise BadRequest(f"rows must have shape ({len(keys)}, {cfg.dim}), got {rows.shape}")
        if state.shape != (len(keys), cfg.state_width):
            raise BadRequest(
                f"state must have shape ({len(keys)}, {cfg.state_width}), got {state.shape}"
            )
        if not (np.isfinite(rows).all() and np.isfinite(state).all()):
            raise BadRequest("rows and state must be finite")
        if cfg.state_min is not None and state.size and state.min() < cfg.state_min:
            raise BadRequest(
                f"state must be >= {cfg.state_min:g} (the optimizer's accumulator), got "
                f"{float(state.min()):g}", field="state",
            )
        self.check_version(version)
        if has_duplicates(local):
            raise BadRequest("a write-back names the same key twice")
        if flush and not is_checkpoint(version, self.config.checkpoint_every):
            raise BadRequest(f"flush version {version} is not a checkpoint iteration", version=version)
        if replay:
            return local
        if flush and version <= self.last_checkpoint:
            raise BadRequest(f"flush version {version} is not a pending checkpoint", version=version)
        stale = self._versions[local] == version if flush else self._versions[local] >= version
        if stale.any():
            i = int(np.flatnonzero(stale)[0])
            raise Conflict(
                f"key {int(keys[i])} is already at version {int(self._versions[local[i]])}; "
                f"write-back version {version} is not newer",
                key=int(keys[i]),
                stored=int(self._versions[local[i]]),
            )
        return local

    # -- reads and writes --------------------------------------------------------------

    def ready(self, local: np.ndarray, min_versions: np.ndarray) -> bool:
        """Whether every row has reached the version asked for."""
        span = bounds(min_versions)
        if span is None or span[1] < 0:  # any version will do (most fetches ask for no other)
            return True
        return self.behind(local, min_versions) == 0

    def behind(self, local: np.ndarray, min_versions: np.ndarray) -> int:
        """How many rows have not reached the version asked for (reads only: unlike
        `gather`, it initialises nothing)."""
        return int((self._versions[local] < min_versions).sum())

    def gather(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of (rows, state, versions) at `local` indices, initialising untouched rows."""
        self._initialise(local)
        stored = self._stored(local)
        return stored.rows, stored.state, stored.versions

    def write_back(
        self,
        local: np.ndarray,
        rows: np.ndarray,
        state: np.ndarray,
        version: int,
        *,
        flush: bool = False,
        replay: bool = False,
    ) -> int:
        """Store a checked write-back (see `check_write`) in one step; returns how many rows
        the table now holds at `version`.

        Rows the table already has at `version` (a replay that landed before) change nothing;
        rows it has newer (a late flush, a replay) only reach the pending checkpoints they
        belong to. `flush` and `replay` were checked by `check_write`: here they change
        nothing, since each row's fate follows from its stored version.
        """
        mine = np.full(len(local), version, dtype=np.int64)
        stored = self._versions[local]
        ahead, behind = stored < mine, stored > mine
        # Values this write hides from a pending checkpoint: the table's rows it moves past
        # one, and its own rows that arrive behind the table's newer ones.
        moved = local[ahead & self._touched[local] & self._serves_pending(stored, mine)]
        late = behind & self._serves_pending(mine, stored)
        written = _rows_at(local, rows, state, mine)
        saved = [
            _Saved(rows=self._stored(moved), until=mine[: len(moved)]),
            _Saved(rows=_take(written, late), until=stored[late]),
        ]
        self._saved += [s for s in saved if len(s.until)]
        # the rows this write moves forward: all of them, not copied, in the usual write-back
        fresh, fresh_rows, fresh_state = (rows_where(ahead, a) for a in (local, rows, state))
        self._held += int(np.count_nonzero(~self._touched[fresh]))  # `local` holds no duplicates
        self._rows[fresh] = fresh_rows
        self._state[fresh] = fresh_state
        self._versions[fresh] = version
        self._touched[fresh] = True
        if fresh.size:
            self.max_version = max(self.max_version, version)
        return int(fresh.size)

    def _stored(self, local: np.ndarray) -> Snapshot:
        """Copies of the table's rows at `local`. np.take makes the same copies as
        ``self._rows[local]``, three to four times faster for rows of a few dozen values: numpy's
        fancy indexing copies them value by value."""
        return _rows_at(
            local, np.take(self._rows, local, axis=0), np.take(self._state, local, axis=0),
            np.take(self._versions, local),
        )

    def _serves_pending(self, versions: np.ndarray, until: np.ndarray) -> np.ndarray:
        """Row by row, whether a checkpoint not taken yet falls in versions <= c < until."""
        every = self.config.checkpoint_every
        if every <= 0:
            return np.zeros(len(versions), dtype=bool)
        start = np.maximum(versions, self.last_checkpoint + 1)
        return first_checkpoint_from(start, every) < until

    def _initialise(self, local: np.ndarray) -> None:
        fresh = local[~self._touched[local]]
        if fresh.size == 0:
            return
        # A row asked for twice is initialised twice, to the same value: cheaper than dedup.
        cfg = self.config
        keys = global_key(fresh, cfg.shard, cfg.num_shards)
        self._rows[fresh] = initial_rows(cfg.layout, cfg.seed, keys, cfg.dim)
        self._state[fresh] = cfg.state_init
        self._touched[fresh] = True
        self._held += int(np.count_nonzero(np.diff(np.sort(fresh)))) + 1

    # -- persistence -------------------------------------------------------------------

    def snapshot(self, checkpoint: int | None = None) -> Snapshot:
        """The touched rows as of iteration `checkpoint` (default: as they are now).

        Taking checkpoint c forgets the saved rows that no later checkpoint needs.
        """
        if checkpoint is None:
            return self._stored(np.flatnonzero(self._touched))
        table = np.flatnonzero(self._touched & (self._versions <= checkpoint))
        saved = [_take(s.rows, (s.rows.versions <= checkpoint) & (checkpoint < s.until)) for s in self._saved]
        self.last_checkpoint = max(self.last_checkpoint, checkpoint)
        kept = (_take_saved(s, self._serves_pending(s.rows.versions, s.until)) for s in self._saved)
        self._saved = [s for s in kept if len(s.until)]
        return self._with_saved(table, _newest(saved), checkpoint)

    def _with_saved(self, table: np.ndarray, saved: Snapshot | None, checkpoint: int) -> Snapshot:
        """Checkpoint `checkpoint` from the table's rows at `table` (sorted, each at a version
        <= checkpoint) and the saved rows that belong to it, the saved row winning where both
        hold one at the same version (it is the later value: a replay or a late flush).

        The rows are copied once, straight from the table into the snapshot, and the saved
        rows written over them: a checkpoint's transient memory is one copy of the rows it
        holds (plus 8-byte indices), whatever the table's size.
        """
        if saved is None:
            return self._stored(table)
        local = _merged(table, saved.local)  # a saved row's table value may be past it
        snap = self._stored(local)
        at = np.searchsorted(local, saved.local)
        wins = (snap.versions[at] > checkpoint) | (saved.versions >= snap.versions[at])
        for name in ("rows", "state", "versions"):
            getattr(snap, name)[at[wins]] = getattr(saved, name)[wins]
        return snap

    def restore(self, snap: Snapshot | Iterable[Snapshot], checkpoint: int = -1) -> None:
        """Replace the shard's contents with checkpoint `checkpoint`'s snapshot, given whole or
        in parts (a resharded one comes chunk by chunk: `ps.checkpoint.resharded`); BadRequest
        if a part does not fit this shard (the shard is then empty)."""
        cfg = self.config
        if self._held:  # a fresh shard (a process restarting) keeps its empty arrays
            self._rows = lazy_zeros((self.num_rows, cfg.dim), np.float32)
            self._state = lazy_zeros((self.num_rows, cfg.state_width), np.float32)
            self._versions = np.full(self.num_rows, -1, dtype=np.int64)
            self._touched = lazy_zeros((self.num_rows,), np.bool_)
        self._saved = []
        self.max_version = -1
        try:
            for part in [snap] if isinstance(snap, Snapshot) else snap:
                self._restore_part(part)
        except BadRequest:
            self.restore([], -1)
            raise
        finally:
            self._held = int(np.count_nonzero(self._touched))  # parts may name a row twice
        self.last_checkpoint = checkpoint

    def _restore_part(self, snap: Snapshot) -> None:
        cfg = self.config
        n = len(snap.local)
        if snap.local.size and (snap.local.min() < 0 or snap.local.max() >= self.num_rows):
            raise BadRequest(f"snapshot indices fall outside this shard's {self.num_rows} rows")
        expected = {"rows": (n, cfg.dim), "state": (n, cfg.state_width), "versions": (n,)}
        for name, shape in expected.items():
            if getattr(snap, name).shape != shape:
                raise BadRequest(f"snapshot {name} has shape {getattr(snap, name).shape}, not {shape}")
        self._rows[snap.local] = snap.rows
        self._state[snap.local] = snap.state
        self._versions[snap.local] = snap.versions
        self._touched[snap.local] = True
        self.max_version = max(self.max_version, int(snap.versions.max(initial=-1)))


def _rows_at(local: np.ndarray, rows: np.ndarray, state: np.ndarray, versions: np.ndarray) -> Snapshot:
    return Snapshot(local=local, rows=rows, state=state, versions=versions)


def _take(snap: Snapshot, keep: np.ndarray) -> Snapshot:
    """Copies of the rows of `snap` where `keep`."""
    return _rows_at(*(np.compress(keep, a, axis=0) for a in (snap.local, snap.rows, snap.state, snap.versions)))


def _take_saved(saved: _Saved, keep: np.ndarray) -> _Saved:
    return saved if keep.all() else _Saved(rows=_take(saved.rows, keep), until=saved.until[keep])


def _merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two sorted arrays of distinct indices, sorted (np.union1d sorts or hashes
    both: ten times slower on a table's millions of indices)."""
    new = b[~in_sorted(b, a)]
    return np.insert(a, np.searchsorted(a, new), new)


def _newest(parts: list[Snapshot]) -> Snapshot | None:
    """One snapshot from parts (None if they hold no row): for each index, its row with the
    highest version (the later part's on a tie), sorted by index."""
    parts = [p for p in parts if len(p.local)]
    if not parts:
        return None
    cat = {name: np.concatenate([getattr(p, name) for p in parts]) for name in ("local", "rows", "state", "versions")}
    local, versions = cat["local"], cat["versions"]
    order = np.lexsort((np.arange(len(local)), versions, local))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = local[order][1:] != local[order][:-1]
    pick = order[last]
    return Snapshot(local=local[pick], rows=cat["rows"][pick], state=cat["state"][pick], versions=versions[pick])
