"""One parameter-server shard as plain numpy: rows, row-wise optimizer state, versions.

Sans-IO: no sockets, clocks or files. The asyncio service (`ps/service.py`) validates
requests through `check_*`, waits for versions with `ready`, and calls `gather` and
`write_back`; `ps/checkpoint.py` persists `snapshot()`.

Rows are initialised lazily, on first touch, from `common.init.initial_rows`, so a shard of a
billion-row table costs only the pages it has touched (`np.zeros` maps untouched memory
lazily) and its values never depend on the number of shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.checkpoints import checkpoints_between, is_checkpoint
from common.errors import BadRequest, Conflict
from common.init import initial_rows
from common.keys import TableLayout, global_key, local_index, shard_of, shard_size


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    shard: int
    num_shards: int
    layout: TableLayout
    dim: int
    state_width: int
    state_init: float = 0.0
    seed: int = 0
    checkpoint_every: int = 0  # 0: none; which iterations: common.checkpoints.is_checkpoint


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The touched rows of a shard (copies), safe to write out while the shard keeps serving.

    Only touched rows are kept: an untouched row is its initial value by definition.
    """

    local: np.ndarray  # int64 [n] local indices
    rows: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_width]
    versions: np.ndarray  # int64 [n]


@dataclass
class _Pending:
    """Rows as of checkpoint c that the live table no longer holds: values saved before a
    newer write replaced them, and flushes of c that arrived after a newer write-back."""

    parts: list[Snapshot]


class ShardStore:
    """Rows, state and versions of one shard, plus the pending checkpoints' saved rows.

    Checkpoint c must hold every row as of iteration c, while write-backs of later
    iterations keep arriving: a write that moves a row past a pending checkpoint first
    saves the row's old value for it (copy on write), and a flush of c that arrives after a
    newer write of the same row (they come from different trainers) goes only to c (and to
    any later pending checkpoint the row has moved past). A checkpoint's row is the one with
    the highest version among what the table and the saved parts hold for it.

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
        self._rows = np.zeros((n, config.dim), dtype=np.float32)
        self._state = np.zeros((n, config.state_width), dtype=np.float32)
        self._versions = np.full(n, -1, dtype=np.int64)
        self._touched = np.zeros(n, dtype=bool)
        self._pending: dict[int, _Pending] = {}
        self.last_checkpoint = -1  # the newest checkpoint taken or restored

    # -- validation --------------------------------------------------------------------

    def check_keys(self, keys: np.ndarray) -> np.ndarray:
        """Local indices of `keys`; BadRequest for a key out of range or on another shard."""
        cfg = self.config
        cfg.layout.check_keys(keys)
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
        if version < 0:
            raise BadRequest(f"version must be >= 0, got {version}")
        if len(np.unique(local)) != len(local):
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
        return bool((self._versions[local] >= min_versions).all())

    def gather(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of (rows, state, versions) at `local` indices, initialising untouched rows."""
        self._initialise(local)
        return self._rows[local], self._state[local], self._versions[local]

    def write_back(
        self,
        local: np.ndarray,
        rows: np.ndarray,
        state: np.ndarray,
        version: int,
        *,
        flush: bool = False,
        replay: bool = False,
    ) -> None:
        """Store a checked write-back (see `check_write`) in one step."""
        if flush or replay:
            stored = self._versions[local]
            behind = stored > version
            if behind.any():
                self._save_behind(local[behind], rows[behind], state[behind], version)
            ahead = stored < version  # a replayed row the table has at `version` landed already
            local, rows, state = local[ahead], rows[ahead], state[ahead]
        self._save_for_checkpoints(local, version)
        self._rows[local] = rows
        self._state[local] = state
        self._versions[local] = version
        self._touched[local] = True

    def _save_behind(self, local: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int) -> None:
        """Rows of `version` that the table has already replaced by newer ones: they are
        still the value of each pending checkpoint c >= version that the table moved past."""
        stored, every = self._versions[local], self.config.checkpoint_every
        for c in checkpoints_between(max(self.last_checkpoint, version - 1), int(stored.max()), every):
            past = stored > c
            self._pending_part(c, local[past], rows[past], state[past], np.full(int(past.sum()), version))

    def _save_for_checkpoints(self, local: np.ndarray, version: int) -> None:
        """Keep the current value of rows this write moves past a pending checkpoint."""
        for c in checkpoints_between(self.last_checkpoint, version, self.config.checkpoint_every):
            crossing = local[self._touched[local] & (self._versions[local] <= c)]
            if crossing.size:
                self._pending_part(c, crossing, self._rows[crossing], self._state[crossing], self._versions[crossing])

    def _pending_part(self, c: int, local: np.ndarray, rows: np.ndarray, state: np.ndarray, versions: np.ndarray) -> None:
        part = Snapshot(local=local, rows=rows.copy(), state=state.copy(), versions=versions.copy())
        self._pending.setdefault(c, _Pending([])).parts.append(part)

    def _initialise(self, local: np.ndarray) -> None:
        fresh = local[~self._touched[local]]
        if fresh.size == 0:
            return
        fresh = np.unique(fresh)
        cfg = self.config
        keys = global_key(fresh, cfg.shard, cfg.num_shards)
        self._rows[fresh] = initial_rows(cfg.layout, cfg.seed, keys, cfg.dim)
        self._state[fresh] = cfg.state_init
        self._touched[fresh] = True

    # -- persistence -------------------------------------------------------------------

    def snapshot(self, checkpoint: int | None = None) -> Snapshot:
        """The touched rows as of iteration `checkpoint` (default: as they are now).

        Taking checkpoint c forgets what was saved for it and for any older one.
        """
        if checkpoint is None:
            local = np.flatnonzero(self._touched)
            return Snapshot(local=local, rows=self._rows[local], state=self._state[local], versions=self._versions[local])
        live = np.flatnonzero(self._touched & (self._versions <= checkpoint))
        parts = [Snapshot(local=live, rows=self._rows[live], state=self._state[live], versions=self._versions[live])]
        parts += self._pending.get(checkpoint, _Pending([])).parts
        self._pending = {c: p for c, p in self._pending.items() if c > checkpoint}
        self.last_checkpoint = max(self.last_checkpoint, checkpoint)
        return _overlay(parts)

    def restore(self, snap: Snapshot, checkpoint: int = -1) -> None:
        """Replace the shard's contents with checkpoint `checkpoint`'s snapshot; BadRequest if
        the snapshot does not fit this shard."""
        cfg = self.config
        n = len(snap.local)
        if snap.local.size and (snap.local.min() < 0 or snap.local.max() >= self.num_rows):
            raise BadRequest(f"snapshot indices fall outside this shard's {self.num_rows} rows")
        expected = {"rows": (n, cfg.dim), "state": (n, cfg.state_width), "versions": (n,)}
        for name, shape in expected.items():
            if getattr(snap, name).shape != shape:
                raise BadRequest(f"snapshot {name} has shape {getattr(snap, name).shape}, not {shape}")
        if self._touched.any():  # a fresh shard (a process restarting) keeps its empty arrays
            self._rows = np.zeros((self.num_rows, cfg.dim), dtype=np.float32)
            self._state = np.zeros((self.num_rows, cfg.state_width), dtype=np.float32)
            self._versions = np.full(self.num_rows, -1, dtype=np.int64)
            self._touched = np.zeros(self.num_rows, dtype=bool)
        self._rows[snap.local] = snap.rows
        self._state[snap.local] = snap.state
        self._versions[snap.local] = snap.versions
        self._touched[snap.local] = True
        self._pending = {}
        self.last_checkpoint = checkpoint

    def max_version(self) -> int:
        return int(self._versions.max(initial=-1))


def _overlay(parts: list[Snapshot]) -> Snapshot:
    """One snapshot from parts: for each index, its row with the highest version (the
    later part's on a tie)."""
    cat = {name: np.concatenate([getattr(p, name) for p in parts]) for name in ("local", "rows", "state", "versions")}
    local, versions = cat["local"], cat["versions"]
    order = np.lexsort((np.arange(len(local)), versions, local))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = local[order][1:] != local[order][:-1]
    pick = order[last]
    return Snapshot(local=local[pick], rows=cat["rows"][pick], state=cat["state"][pick], versions=versions[pick])
