"""One trainer's iteration loop: the boundary of DESIGN §4, forward/backward, and the sync.

For each directive x the engine runs, in this order (the simulator showed other orders
deadlock or read stale rows):

0. issue x's prefetches at once;
1. apply sync_later(x−2) to the copies that stay and to the rows held back for write-back,
   and send those write-backs;
2. join sources read the rows they send (one collective carries value and state);
3. copies leaving after x−1 leave; writers copy their rows out and send them, unless the key
   is in sync_later(x−1): those are held until step 1 of the next boundary;
4. joined rows are written into the joiners' slots;
5. wait for the fetches targeting x and insert them;
6. forward and backward on x;
7. sync_now(x) is reduced and applied in every copy's slot, one-copy keys are updated
   locally, sync_later(x) is launched asynchronously.

Gradients follow DESIGN §5: each trainer's loss is the mean over its slice, dense gradients
are averaged by DDP, embedding gradients are summed across trainers and divided by T.
Network I/O is handed to `RowSource` (futures); the engine waits only where the order says.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from common.directive import Directive
from trainer.cache import EmbeddingCache
from trainer.collectives import Collectives, Work
from trainer.timing import PhaseTimer

Future = concurrent.futures.Future


class RowSource(Protocol):
    """Asynchronous access to the PS (see `trainer.remote.RemoteRows`)."""

    def fetch(self, keys: np.ndarray, min_versions: np.ndarray) -> Future: ...

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, flush: bool) -> Future: ...


@dataclass
class IterationStats:
    iteration: int
    samples: int
    loss: float
    uses: int = 0
    hits: int = 0
    fetch_rows: int = 0
    write_back_rows: int = 0
    sync_rows: int = 0
    join_rows: int = 0
    probs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))


@dataclass
class _PendingSync:
    """sync_later(e) in flight, with what is needed to apply it at the boundary into e+2."""

    work: Work
    grad: torch.Tensor  # [M, d], summed across trainers once `work` is done
    keys: np.ndarray  # int64 [M], ascending
    slots: np.ndarray  # int32 [M], this trainer's slot during e or −1
    left: np.ndarray  # bool [M], the copy left after e (its slot may hold another key now)


@dataclass
class _HeldRows:
    """Rows copied out for write-back that wait for sync_later(version) before being sent."""

    version: int
    keys: np.ndarray
    rows: np.ndarray
    state: np.ndarray
    flush: np.ndarray  # bool: a checkpoint flush of a row that stays cached


@dataclass
class _Fetch:
    future: Future
    slots: np.ndarray


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
        write_lag: int = 32,
        on_checkpoint_written: Callable[[int, list[Future]], None] | None = None,
    ) -> None:
        self.cache = cache
        self.model = model
        self.dense_optimizer = dense_optimizer
        self.comm = collectives
        self.rows = rows
        self.timer = timer
        self.write_lag = write_lag
        self.on_checkpoint_written = on_checkpoint_written
        self._checkpoints: list[int] = []  # marked iterations whose writes are not all sent
        self.device = cache.device.torch_device
        self._prev: Directive | None = None
        self._fetches: dict[int, list[_Fetch]] = {}
        self._later: dict[int, _PendingSync] = {}
        self._held: dict[int, _HeldRows] = {}
        self._writes: list[tuple[int, Future]] = []
        self.fetched_rows = 0
        self.written_rows = 0

    # -- the iteration -------------------------------------------------------------------

    def step(self, d: Directive, labels: np.ndarray, dense: np.ndarray) -> IterationStats:
        """Run the boundary into d.iteration, then forward/backward and the end of it."""
        x = d.iteration
        stats = IterationStats(iteration=x, samples=len(labels), loss=0.0)
        with self.timer.phase("boundary"):
            self._issue_prefetches(d)
            self._bound_write_lag(x)
            self._apply_sync_later(x - 2)
            self._checkpoints_sent(up_to=x - 2)
            joined = self._read_join_sources(d)
            self._leave(self._prev)
            self._write_joins(d, joined)
            stats.join_rows = len(d.join_keys)
        with self.timer.phase("wait_prefetch"):
            fetched = self._insert_fetched(x)
        self._train(d, labels, dense, stats)
        filled = np.concatenate([fetched, d.join_recv_slots[d.join_recv_slots >= 0]])
        stats.fetch_rows = len(fetched)
        # A hit is a used row that was resident before this boundary's fetches and joins.
        stats.hits = stats.uses - int(np.isin(np.unique(d.input_slots), filled).sum())
        if d.checkpoint:
            self._checkpoints.append(x)
        self._prev = d
        return stats

    def drain(self) -> None:
        """After the last directive: the boundaries into N and N+1 without new work, then wait
        until the PS has acknowledged every write-back."""
        if self._prev is None:
            return
        n = self._prev.iteration + 1
        with self.timer.phase("boundary"):
            self._apply_sync_later(n - 2)
            self._leave(self._prev)
            self._prev = None
            self._apply_sync_later(n - 1)
            self._checkpoints_sent(up_to=n)
        self.wait_for_writes()
        if self._fetches:
            raise RuntimeError(f"fetches for iterations {sorted(self._fetches)} were never used")

    def wait_for_writes(self, up_to: int | None = None) -> None:
        """Block until write-backs of versions <= `up_to` (default: all) are acknowledged."""
        keep = []
        for version, future in self._writes:
            if up_to is None or version <= up_to:
                future.result()
            else:
                keep.append((version, future))
        self._writes = keep

    def _checkpoints_sent(self, up_to: int) -> None:
        """Hand over marked checkpoints <= `up_to`: every write of theirs has been sent."""
        while self._checkpoints and self._checkpoints[0] <= up_to:
            c = self._checkpoints.pop(0)
            if self.on_checkpoint_written is not None:
                self.on_checkpoint_written(c, [f for v, f in self._writes if v <= c])

    # -- boundary steps ------------------------------------------------------------------

    def _issue_prefetches(self, d: Directive) -> None:
        if not len(d.prefetch_keys):
            return
        assert self.rows is not None, "a directive with prefetches needs a PS"
        targets = d.prefetch_targets
        for target in np.unique(targets):
            mine = targets == target
            future = self.rows.fetch(d.prefetch_keys[mine], d.prefetch_min_versions[mine])
            self._fetches.setdefault(int(target), []).append(_Fetch(future, d.prefetch_slots[mine]))

    def _bound_write_lag(self, x: int) -> None:
        with self.timer.phase("write_back_queue"):
            self.wait_for_writes(up_to=x - self.write_lag)
        for _, future in self._writes:  # surface a failed write-back at once, not at the end
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _apply_sync_later(self, e: int) -> None:
        pending = self._later.pop(e, None)
        if pending is None:
            return
        with self.timer.phase("sync_later_wait"):
            pending.work.wait()
        grad = pending.grad / self.comm.world_size
        with self.timer.phase("optimizer"):
            stay = (pending.slots >= 0) & ~pending.left
            self.cache.apply(pending.slots[stay], grad[torch.from_numpy(stay).to(self.device)])
            held = self._held.pop(e, None)
            if held is not None:
                pos = torch.from_numpy(np.searchsorted(pending.keys, held.keys)).to(self.device)
                rows = torch.from_numpy(held.rows).to(self.device)
                state = torch.from_numpy(held.state).to(self.device)
                self.cache.optimizer.step(rows, state, grad[pos].contiguous())
                self._send(held.keys, rows.cpu().numpy(), state.cpu().numpy(), e, held.flush)

    def _read_join_sources(self, d: Directive) -> torch.Tensor | None:
        if not len(d.join_keys):
            return None
        width = self.cache.dim + self.cache.state_width
        buf = torch.zeros(len(d.join_keys), width, device=self.device)
        send = d.join_send_slots >= 0
        if send.any():
            rows, state = self.cache.read(d.join_send_slots[send])
            buf[torch.from_numpy(send).to(self.device)] = torch.cat([rows, state], dim=1)
        self.comm.all_reduce(buf)  # one holder sends, the others add zeros: exact copies
        return buf

    def _leave(self, prev: Directive | None) -> None:
        """Copies leaving after prev's iteration leave; writers copy out and send (or hold)."""
        if prev is None or not len(prev.write_keys):
            return
        rows, state = self.cache.read_host(prev.write_slots)
        flush = ~np.isin(prev.write_slots, prev.leave_slots)  # the row stays: a checkpoint copy
        self._send_or_hold(prev, prev.write_keys, rows, state, flush)

    def _send_or_hold(self, prev: Directive, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, flush: np.ndarray) -> None:
        e = prev.iteration
        later = np.isin(keys, prev.sync_later_keys)
        if later.any():
            self._held[e] = _HeldRows(version=e, keys=keys[later], rows=rows[later], state=state[later], flush=flush[later])
        now = ~later
        if now.any():
            self._send(keys[now], rows[now], state[now], e, flush[now])

    def _send(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, flush: np.ndarray) -> None:
        """Write back evicted rows and checkpoint flushes (separate requests: a flush may be
        older than what the PS holds by the time it lands)."""
        assert self.rows is not None, "a directive with write-backs needs a PS"
        for kind in (False, True):
            part = flush == kind
            if part.any():
                future = self.rows.write_back(keys[part], rows[part], state[part], version, kind)
                self._writes.append((version, future))
        self.written_rows += len(keys)

    def _write_joins(self, d: Directive, joined: torch.Tensor | None) -> None:
        if joined is None:
            return
        recv = d.join_recv_slots >= 0
        if recv.any():
            part = joined[torch.from_numpy(recv).to(self.device)]
            self.cache.write(d.join_recv_slots[recv], part[:, : self.cache.dim], part[:, self.cache.dim :])

    def _insert_fetched(self, x: int) -> np.ndarray:
        """Wait for the fetches targeting x and write them into their slots; returns the slots."""
        filled = [np.zeros(0, np.int32)]
        for fetch in self._fetches.pop(x, []):
            got = fetch.future.result()
            self.cache.write_host(fetch.slots, got.rows, got.state)
            filled.append(fetch.slots)
        slots = np.concatenate(filled)
        self.fetched_rows += len(slots)
        return slots

    # -- compute and sync ----------------------------------------------------------------

    def _train(self, d: Directive, labels: np.ndarray, dense: np.ndarray, stats: IterationStats) -> None:
        dev = self.device
        with self.timer.phase("forward"):
            slots = torch.from_numpy(d.input_slots.astype(np.int64)).to(dev)  # (b, F)
            used, inverse = torch.unique(slots, return_inverse=True)  # (U,), (b, F)
            leaf = self.cache.rows[used].detach().requires_grad_()  # (U, d)
            logits = self.model(torch.from_numpy(dense.copy()).to(dev), leaf[inverse])  # (b,)
            target = torch.from_numpy(labels.copy()).to(dev)
            loss = F.binary_cross_entropy_with_logits(logits, target)
        with self.timer.phase("backward"):
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with self.timer.phase("optimizer"):
            self.dense_optimizer.step()
        used_slots = used.cpu().numpy()
        grad = leaf.grad  # (U, d): each used slot's gradient, summed over its uses
        with self.timer.phase("sync_now"):
            self._sync_now(d, used_slots, grad)
        with self.timer.phase("optimizer"):
            self._update_one_copy_keys(d, used_slots, grad)
        self._launch_sync_later(d, used_slots, grad)
        stats.loss = float(loss.detach())
        stats.uses = len(used_slots)
        stats.sync_rows = len(d.sync_now_keys) + len(d.sync_later_keys)
        stats.probs = torch.sigmoid(logits.detach()).cpu().numpy()
        stats.labels = labels

    def _local_grads(self, slots: np.ndarray, used: np.ndarray, grad: torch.Tensor) -> torch.Tensor:
        """[len(slots), d]: this trainer's gradient for each listed slot, zero where unused."""
        out = torch.zeros(len(slots), grad.shape[1], device=self.device)
        pos = np.searchsorted(used, slots)
        hit = (slots >= 0) & (pos < len(used))
        hit[hit] = used[pos[hit]] == slots[hit]
        if hit.any():
            out[torch.from_numpy(hit).to(self.device)] = grad[torch.from_numpy(pos[hit]).to(self.device)]
        return out

    def _sync_now(self, d: Directive, used: np.ndarray, grad: torch.Tensor) -> None:
        if not len(d.sync_now_keys):
            return
        buf = self._local_grads(d.sync_now_slots, used, grad)
        self.comm.all_reduce(buf)
        mine = d.sync_now_slots >= 0
        self.cache.apply(d.sync_now_slots[mine], (buf / self.comm.world_size)[torch.from_numpy(mine).to(self.device)])

    def _update_one_copy_keys(self, d: Directive, used: np.ndarray, grad: torch.Tensor) -> None:
        synced = np.concatenate([d.sync_now_slots, d.sync_later_slots])
        alone = ~np.isin(used, synced)
        if alone.any():
            idx = torch.from_numpy(np.flatnonzero(alone)).to(self.device)
            self.cache.apply(used[alone], grad[idx] / self.comm.world_size)

    def _launch_sync_later(self, d: Directive, used: np.ndarray, grad: torch.Tensor) -> None:
        if not len(d.sync_later_keys):
            return
        buf = self._local_grads(d.sync_later_slots, used, grad)
        self._later[d.iteration] = _PendingSync(
            work=self.comm.all_reduce_async(buf),
            grad=buf,
            keys=d.sync_later_keys,
            slots=d.sync_later_slots,
            left=np.isin(d.sync_later_slots, d.leave_slots),
        )
