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


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The touched rows of a shard (copies), safe to write out while the shard keeps serving.

    Only touched rows are kept: an untouched row is its initial value by definition.
    """

    local: np.ndarray  # int64 [n] local indices
    rows: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_width]
    versions: np.ndarray  # int64 [n]


class ShardStore:
    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        n = shard_size(config.layout.total_rows, config.shard, config.num_shards)
        self.num_rows = n
        self._rows = np.zeros((n, config.dim), dtype=np.float32)
        self._state = np.zeros((n, config.state_width), dtype=np.float32)
        self._versions = np.full(n, -1, dtype=np.int64)
        self._touched = np.zeros(n, dtype=bool)

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

    def check_write(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int) -> np.ndarray:
        """Local indices for a valid write-back; raises without changing anything otherwise."""
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
        stale = self._versions[local] >= version
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

    def write_back(self, local: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int) -> None:
        """Store a checked write-back (see `check_write`) in one step."""
        self._rows[local] = rows
        self._state[local] = state
        self._versions[local] = version
        self._touched[local] = True

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

    def snapshot(self) -> Snapshot:
        local = np.flatnonzero(self._touched)
        return Snapshot(
            local=local,
            rows=self._rows[local],
            state=self._state[local],
            versions=self._versions[local],
        )

    def restore(self, snap: Snapshot) -> None:
        """Replace the shard's contents; BadRequest if the snapshot does not fit this shard."""
        cfg = self.config
        n = len(snap.local)
        if snap.local.size and (snap.local.min() < 0 or snap.local.max() >= self.num_rows):
            raise BadRequest(f"snapshot indices fall outside this shard's {self.num_rows} rows")
        expected = {"rows": (n, cfg.dim), "state": (n, cfg.state_width), "versions": (n,)}
        for name, shape in expected.items():
            if getattr(snap, name).shape != shape:
                raise BadRequest(f"snapshot {name} has shape {getattr(snap, name).shape}, not {shape}")
        self._rows = np.zeros((self.num_rows, cfg.dim), dtype=np.float32)
        self._state = np.zeros((self.num_rows, cfg.state_width), dtype=np.float32)
        self._versions = np.full(self.num_rows, -1, dtype=np.int64)
        self._touched = np.zeros(self.num_rows, dtype=bool)
        self._rows[snap.local] = snap.rows
        self._state[snap.local] = snap.state
        self._versions[snap.local] = snap.versions
        self._touched[snap.local] = True

    def max_version(self) -> int:
        return int(self._versions.max(initial=-1))
