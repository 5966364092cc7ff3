"""One trainer's iteration loop: executes the actions of `trainer.boundary.Boundary`.

The order (docs/design.md#the-boundary, steps 0-7) lives in `Boundary`; this file only
carries each action out with torch tensors, the PS futures of a `RowSource` and the trainers'
collectives, and times it. Gradients follow docs/design.md#exact-arithmetic: each trainer's loss is the mean over
its slice, dense gradients are averaged by DDP, embedding gradients are summed across
trainers in rank order (`Collectives.sum_rows`) and divided by T, for one-copy keys too.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from common.arrays import rows_where
from common.directive import WRITE_LAG, Directive
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
from trainer.cache import EmbeddingCache
from trainer.collectives import Collectives, RowSum
from trainer.timing import PhaseTimer

Future = concurrent.futures.Future
#: How often a wait for the PS looks whether a background sum has failed (`request_result`).
_FAILURE_CHECK_S = 0.5
#: Called once every write-back of checkpoint c has been sent, with their futures.
CheckpointCallback = Callable[[int, list[Future]], None]


class RowSource(Protocol):
    """Asynchronous access to the PS (`trainer.remote.RemoteRows`; in tests, shard stores)."""

    def fetch(self, keys: np.ndarray, min_versions: np.ndarray) -> Future: ...

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, flush: bool) -> Future: ...

    def release(self, fetched: Any) -> None:
        """A fetch's result has been copied where it goes (its memory may be reused)."""


@dataclass
class IterationStats:
    iteration: int
    samples: int
    loss: float
    uses: int = 0
    hits: int = 0
    fetch_rows: int = 0
    write_back_rows: int = 0
    sync_now_rows: int = 0
    sync_later_rows: int = 0
    join_rows: int = 0
    probs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))


@dataclass
class _HeldRows:
    """Rows copied out for write-back that wait for sync_later(version) before being sent."""

    rows: np.ndarray
    state: np.ndarray


class Engine:
    def __init__(
        self,
        *,
        cache: EmbeddingCache,
        model: torch.nn.Module,
        dense_optimizer: torch.optim.Optimizer,
        collectives: Collectives,
        rows: RowSource | None,
        timer: PhaseTimer,
        write_lag: int = WRITE_LAG,
        on_checkpoint_written: CheckpointCallback | None = None,
    ) -> None:
        self.cache = cache
        self.model = model
        self.dense_optimizer = dense_optimizer
        self.comm = collectives
        self.rows = rows
        self.timer = timer
        self.boundary = Boundary(write_lag=write_lag)
        self.on_checkpoint_written = on_checkpoint_written
        self.device = cache.device.torch_device
        self._fetches: dict[int, list[tuple[Future, Future, np.ndarray]]] = {}  # target -> (fetch, staged, slots)
        self._later: dict[int, RowSum] = {}
        self._held: dict[int, _HeldRows] = {}
        self._writes: list[tuple[int, Future]] = []
        self._joined: RowSum | None = None
        # (U + 1, d): the current iteration's used-row gradients, then a zero row that
        # position -1 reads (no mask, no zero buffer where a sync list has keys not used here)
        self._grad: torch.Tensor | None = None
        self._now: tuple[np.ndarray, torch.Tensor, np.ndarray] | None = None  # sync_now: slots, sum, positions
        self._batch: tuple[np.ndarray, np.ndarray] | None = None
        self._stats: IterationStats | None = None
        self.fetched_rows = 0
        self.written_rows = 0
        # Each action's executor and the phase its time counts in (`Train` times its parts).
        self._executors: dict[type, tuple[Callable[[Any], None], str | None]] = {
            IssueFetches: (self._issue_fetches, "boundary"),
            WaitWrites: (self._wait_writes, "write_back_queue"),
            ApplySyncLater: (self._apply_sync_later, "sync_later_wait"),
            CheckpointsWritten: (self._checkpoints_written, "boundary"),
            ReadJoinSources: (self._read_join_sources, "boundary"),
            Leave: (self._leave, "boundary"),
            WriteJoins: (self._write_joins, "boundary"),
            InsertFetched: (self._insert_fetched, "wait_prefetch"),
            Train: (self._train, None),
            SyncNow: (self._sync_now, "sync_now"),
            UpdateAlone: (self._update_alone, "embedding_update"),
            LaunchSyncLater: (self._launch_sync_later, "sync_now"),
        }

    # -- the iteration -------------------------------------------------------------------

    def step(self, d: Directive, labels: np.ndarray, dense: np.ndarray) -> IterationStats:
        """Run the boundary into d.iteration, then forward/backward and the end of it."""
        stats = IterationStats(iteration=d.iteration, samples=len(labels), loss=0.0, join_rows=len(d.join_keys))
        self._batch, self._stats = (labels, dense), stats
        written = self.written_rows
        with self.timer.phase("boundary"):
            actions = self.boundary.plan(d)
        self._execute(actions)
        stats.write_back_rows = self.written_rows - written
        self._batch = self._stats = self._grad = None
        return stats

    def drain(self) -> None:
        """After the last directive: the boundaries into N and N+1 without new work, then wait
        until the PS has acknowledged every write-back."""
        with self.timer.phase("boundary"):
            actions = self.boundary.drain()
        self._execute(actions)
        self.wait_for_writes()

    def wait_for_writes(self, up_to: int | None = None) -> None:
        """Block until write-backs of versions <= `up_to` (default: all) are acknowledged."""
        keep = []
        for version, future in self._writes:
            if up_to is None or version <= up_to:
                request_result(future, self.comm)
            else:
                keep.append((version, future))
        self._writes = keep

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            execute, phase = self._executors[type(action)]
            if phase is None:
                execute(action)
            else:
                with self.timer.phase(phase):
                    execute(action)

    # -- the boundary into x ---------------------------------------------------------------

    def _issue_fetches(self, a: IssueFetches) -> None:
        for group in a.groups:
            assert self.rows is not None, "a directive with prefetches needs a PS"
            fetch = self.rows.fetch(group.keys, group.min_versions)
            staged = self.cache.device.stage_when_done(fetch)  # copied as soon as it arrives
            self._fetches.setdefault(group.target, []).append((fetch, staged, group.slots))

    def _wait_writes(self, a: WaitWrites) -> None:
        self.wait_for_writes(up_to=a.up_to)
        # Acknowledged write-backs leave the list, and a failed one surfaces at once, not at
        # the end: it keeps the few in flight, where it kept the last WRITE_LAG iterations'
        # (about 60 at T = 2, each asked again at every boundary: 0.4 ms of an iteration).
        self._writes = [(version, future) for version, future in self._writes if not _acknowledged(future)]

    def _apply_sync_later(self, a: ApplySyncLater) -> None:
        pending = self._later.pop(a.iteration, None)
        if pending is None:
            return
        total, t = pending.wait(), self.comm.world_size
        self.cache.apply(a.slots, total, a.positions, divisor=t)
        held = self._held.pop(a.iteration, None)
        if held is not None:
            # The held copies stepped as a table of their own: on the CPU in place, by the
            # fused kernel, the same bits as the torch ops
            rows, state = self.cache.device.upload(held.rows), self.cache.device.upload(held.state)
            each = self.cache.index(np.arange(len(a.held_keys)))
            self.cache.optimizer.step_at(rows, state, each, total, positions=self.cache.index(a.held_positions),
                                         divisor=t)
            self._send(a.held_keys, rows.cpu().numpy(), state.cpu().numpy(), a.iteration, a.held_flush)

    def _checkpoints_written(self, a: CheckpointsWritten) -> None:
        for c in a.iterations:
            if self.on_checkpoint_written is not None:
                self.on_checkpoint_written(c, [f for v, f in self._writes if v <= c])

    def _read_join_sources(self, a: ReadJoinSources) -> None:
        if not len(a.keys):
            return
        buf = torch.zeros(len(a.keys), self.cache.dim + self.cache.state_width, device=self.device)
        send = np.flatnonzero(a.send_slots >= 0)
        if send.size:
            rows, state = self.cache.read(a.send_slots[send])
            # by position, not by mask: torch's boolean index_put finds the positions itself
            buf.index_copy_(0, self.cache.index(send), torch.cat([rows, state], dim=1))
        # One holder sends, the others add zeros: exact copies. At T = 2 step 3 runs while it
        # travels; above, its chunks do (`OrderedSum`), the fold and the gather at step 4.
        self._joined = self.comm.sum_rows(buf)

    def _leave(self, a: Leave) -> None:
        if not len(a.keys):
            return
        rows, state = self.cache.read_host(a.slots)
        if a.hold.any():
            self._held[a.iteration] = _HeldRows(rows=rows_where(a.hold, rows), state=rows_where(a.hold, state))
        now = ~a.hold
        if now.any():
            keys, rows, state, flush = (rows_where(now, v) for v in (a.keys, rows, state, a.flush))
            self._send(keys, rows, state, a.iteration, flush)

    def _send(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, flush: np.ndarray) -> None:
        """Write back evicted rows and checkpoint flushes (separate requests: a flush may be
        older than what the PS holds by the time it lands)."""
        assert self.rows is not None, "a directive with write-backs needs a PS"
        for kind in (False, True):
            part = flush == kind
            if part.any():
                sent = (rows_where(part, v) for v in (keys, rows, state))
                self._writes.append((version, self.rows.write_back(*sent, version, kind)))
        self.written_rows += len(keys)

    def _write_joins(self, a: WriteJoins) -> None:
        pending, self._joined = self._joined, None
        if pending is None:
            return
        joined = pending.wait()
        if not len(a.slots):
            return
        part = self._take(joined, a.positions)
        self.cache.write(a.slots, part[:, : self.cache.dim], part[:, self.cache.dim :])

    def _insert_fetched(self, a: InsertFetched) -> None:
        for fetch, staged, slots in self._fetches.pop(a.target, []):
            # The fetch first: a source whose answers are read by whoever waits for them
            # (`trainer.ps_process`) completes it, and so stages it, only then.
            fetched = request_result(fetch, self.comm)
            self.cache.insert(slots, request_result(staged, self.comm))
            self.rows.release(fetched)  # type: ignore[union-attr]  (a fetch needs a PS)
        self.fetched_rows += len(a.slots)
        assert self._stats is not None
        self._stats.fetch_rows = len(a.slots)

    # -- compute and the end of x ----------------------------------------------------------

    def _train(self, a: Train) -> None:
        assert self._batch is not None and self._stats is not None
        labels, dense = self._batch
        with self.timer.phase("forward"):
            # (U + 1, d): the used rows and one more that no input reads, so its gradient is 0
            leaf = self._take(self.cache.rows, np.append(a.used, 0)).detach().requires_grad_()
            uses = self._take(leaf, a.inverse.reshape(-1)).view(*a.inverse.shape, -1)
            device = self.cache.device
            logits = self.model(device.upload(dense.copy()), uses)  # (b,)
            loss = F.binary_cross_entropy_with_logits(logits, device.upload(labels.copy()))
            device.synchronize()  # each phase times its work on the device too (no-op on the CPU)
        with self.timer.phase("backward"):
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            device.synchronize()
        with self.timer.phase("dense_optimizer"):
            self.dense_optimizer.step()
            device.synchronize()
        self._grad = leaf.grad  # each used slot's gradient, summed over its uses; then zeros
        stats = self._stats
        # Reading the loss waits for the device stream, so on CUDA too the CPU goes on only
        # after DDP's all-reduce, which every trainer has entered: the next directive's fetches
        # rely on it (`common.directive.landed_through`). Keep a host sync here.
        stats.loss = float(loss.detach())
        stats.uses, stats.hits = len(a.used), a.hits
        stats.probs = torch.sigmoid(logits.detach()).cpu().numpy()
        stats.labels = labels

    def _local_grads(self, positions: np.ndarray) -> torch.Tensor:
        """[len(positions), d]: row positions[i] of this iteration's gradients, zero where -1."""
        assert self._grad is not None
        zero_row = len(self._grad) - 1
        return self._take(self._grad, np.where(positions >= 0, positions, zero_row))

    def _sync_now(self, a: SyncNow) -> None:
        if not len(a.keys):
            return
        total = self.comm.sum_rows(self._local_grads(a.positions)).wait()
        mine = np.flatnonzero(a.slots >= 0)
        self._now = (a.slots[mine], total, mine)  # divided by T when applied
        assert self._stats is not None
        self._stats.sync_now_rows = len(a.keys)

    def _update_alone(self, a: UpdateAlone) -> None:
        """One optimizer step for sync_now's copies and the one-copy keys (disjoint slots)."""
        assert self._grad is not None
        t = self.comm.world_size
        now, self._now = self._now, None
        if now is not None:
            slots, total, positions = now
            self.cache.apply(slots, total, positions, divisor=t)
        self.cache.apply(a.slots, self._grad, a.positions, divisor=t)

    def _launch_sync_later(self, a: LaunchSyncLater) -> None:
        if not len(a.keys):
            return
        self._later[a.iteration] = self.comm.sum_rows(self._local_grads(a.positions), background=True)
        assert self._stats is not None
        self._stats.sync_later_rows = len(a.keys)

    def _take(self, rows: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        """``rows[positions]`` (positions >= 0) by `index_select`: the same copy as indexing
        with a tensor, several times faster on the CPU for rows of a few dozen values."""
        return rows.index_select(0, self.cache.index(positions))


def request_result(future: Future, comm: Collectives) -> Any:
    """`future.result()` of a PS request, raising instead the error of a background sum that
    fails meanwhile: the peer it waited for is gone, and the request may be waiting for that
    peer's write-back (a prefetch's version), which the PS would wait out for fetch_timeout_s
    (120 s by default) before the trainer reported it as the PS's fault. Looked at every
    `_FAILURE_CHECK_S`; a request that has answered returns at once."""
    while True:
        try:
            return future.result(timeout=_FAILURE_CHECK_S)
        except TimeoutError:
            if future.done():  # the request's own error
                raise
            failure = comm.background_failure()
            if failure is not None:
                raise failure from None


def _acknowledged(write: Future) -> bool:
    """Whether a write-back has succeeded; raises its error if it failed."""
    if not write.done():
        return False
    error = write.exception()
    if error is not None:
        raise error
    return True
