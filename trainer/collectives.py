"""The trainers' process group and the two collectives the embedding sync needs.

Created once per process and passed around as an object (never a module global). With one
trainer every collective is the identity, so T = 1 runs the same code.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.addresses import address_towards
from common.errors import Unavailable
from common.spec import Endpoint

log = logging.getLogger(__name__)

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class Work(Protocol):
    def wait(self) -> Any: ...


class RowSum:
    """A sum across trainers in flight; `wait()` returns it (a tensor like the one given).
    The first `wait()` finishes it; later ones return the same tensor."""

    def __init__(self, work: Work | None, result: Callable[[], torch.Tensor]) -> None:
        self._work = work
        self._result: Callable[[], torch.Tensor] | None = result
        self._done: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            if self._work is not None:
                self._work.wait()
            self._done, self._result = self._result(), None
        assert self._done is not None
        return self._done


#: Tags of the pairwise exchanges (`PairSum`): one per thread that exchanges on a group, so
#: that each thread's messages pair up in the order that thread sent them.
TRAINING_THREAD_TAG = 1
BACKGROUND_TAG = 2


class PairSum:
    """`tensor` plus the other trainer's of a group of two, in place: each sends its buffer
    and receives the other's (gloo's send and recv, started here and carried by its
    transport threads), and `wait()` adds the two. One round trip, where gloo's all-reduce
    takes several: 0.2-0.5 against 0.7-2 ms for 16 to 160k floats, between two processes on
    loopback or two threads (docs/design.md, "Embedding sync"). The same bytes as a ring
    all-reduce of two, and a + b = b + a, so both trainers hold the same bits, and those of
    the all-reduce."""

    def __init__(self, group: Any, tensor: torch.Tensor, rank: int, tag: int) -> None:
        if not tensor.is_contiguous():
            raise ValueError("a pairwise sum needs a contiguous tensor (it is sent as it lies in memory)")
        self._tensor = tensor
        self._theirs = torch.empty_like(tensor)
        self._sent = group.send([tensor], 1 - rank, tag)
        self._received = group.recv([self._theirs], 1 - rank, tag)

    def wait(self) -> torch.Tensor:
        self._received.wait()
        self._sent.wait()  # before the add: the buffer being sent is the one added into
        return self._tensor.add_(self._theirs)


@dataclass(frozen=True)
class Collectives:
    """The trainers' process groups. Data-plane collectives call the group objects directly,
    so groups built in one process (launcher/inprocess.py) run this code.

    `background` (default: `group`) carries the sums that are not waited for at once
    (sync_later): a process group runs its collectives one after another, so on `group`
    the next boundary's join and the sync_now after it would queue behind them. One thread
    of this object's starts and awaits the background sums (above two trainers each is two
    collectives with a fold between them), in the order they were started, so that every
    trainer issues the same collectives in the same order on the background group, and the
    training thread pays neither gloo's launch nor the fold. `close()` stops it.
    """

    world_size: int
    rank: int
    group: Any  # torch.distributed.ProcessGroup
    background: Any = None
    _runner: list[_Runner] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.background is None:
            object.__setattr__(self, "background", self.group)

    def sum_rows(self, tensor: torch.Tensor, *, background: bool = False) -> RowSum:
        """Start the sum of `tensor` across trainers, added in rank order for every element,
        whatever its position: ((g0 + g1) + g2) + ... . A ring all-reduce adds each chunk
        starting at a different rank, so the same row summed at two positions of a buffer
        could differ in its last bits, and modes lay their sync buffers out differently.

        Two trainers need no care (a + b = b + a): a `PairSum`, one exchange. More reduce in
        rank order at the cost of a ring all-reduce (`OrderedSum`): each trainer receives
        about 2 (T - 1) / T of the buffer whatever T is. Above two trainers the result is a
        new tensor (the input's values are kept, and must not change until `wait()`); at two
        it is the input, summed in place. Sums started on the training thread are waited
        for in the order they were started.

        Joins are summed here too, though any order would do for them (one trainer sends
        each row, the others zeros): `ordered_sum` is faster than gloo's all-reduce from
        four trainers on (docs/design.md, "Embedding sync").
        """
        if self.world_size == 1 or not tensor.numel():
            return RowSum(None, lambda: tensor)
        if not background:
            if self.world_size == 2:
                return _sum_of_two(self.group, tensor, self.rank, TRAINING_THREAD_TAG)
            if tensor.is_cpu:
                return RowSum(None, OrderedSum(self.group, tensor, self.rank, self.world_size, TRAINING_THREAD_TAG).wait)
            total = ordered_sum(self.group, tensor, self.rank, self.world_size)
            return RowSum(None, lambda: total)
        # Started on the background thread at any T: what starts a sum runs on the calling
        # thread (the socket writes of its sends, 177 us for 56k floats), and the fold on
        # the thread that waits, neither of which the training thread need pay for.
        sum_of = _background_sum_of_two if self.world_size == 2 else _background_ordered_sum
        future = self._background_runner().submit(sum_of, self.background, tensor, self.rank, self.world_size)
        return RowSum(None, future.result)

    def mean_gradients_hook(self) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
        """A DDP communication hook that averages a bucket of dense gradients as the
        data-parallel reference does: each trainer's gradient times 1/T, summed in rank order
        (`ordered_sum`). DDP's own all-reduce adds in ring order, exact only at T <= 2.

        At T = 2 DDP keeps its own all-reduce: exact there, and run by gloo's threads while
        backward goes on, where a `PairSum` would write the bucket to the socket from the
        training thread (the dense gradients are the largest buffer an iteration sends)."""

        # DDP reads the annotations of `bucket` and of the result, and this module's are
        # strings (postponed evaluation): it would refuse them, so the hook has none.
        def hook(_, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            flat = bucket.buffer()
            flat.mul_(1.0 / self.world_size)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(ordered_sum(self.group, flat, self.rank, self.world_size))
            return done

        return hook

    def all_gather_objects(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def background_failure(self) -> BaseException | None:
        """The error of a background sum that failed, if one has: a peer is gone. A training
        thread that waits for something else meanwhile raises it rather than wait on, for
        what it waits for may never come: a prefetch of a row at the version that peer was
        to write back, once that sum had ended (`trainer.engine.request_result`)."""
        return self._runner[0].failure if self._runner else None

    def close(self) -> None:
        """Stop the background thread, after the sums it was given."""
        for runner in self._runner:
            runner.close()
        self._runner.clear()

    def _background_runner(self) -> _Runner:
        if not self._runner:
            self._runner.append(_Runner(f"sync-later-{self.rank}"))
        return self._runner[0]


class _Runner:
    """One daemon thread running submitted calls in order. A daemon, unlike an executor's
    worker: a trainer that fails while a sum waits in gloo must still exit at once."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self.failure: BaseException | None = None  # the first call that raised
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the trainer's thread re-raises it at wait()
                if self.failure is None:
                    self.failure = exc
                future.set_exception(exc)


def _sum_of_two(group: Any, tensor: torch.Tensor, rank: int, tag: int) -> RowSum:
    """`tensor` plus the other trainer's, in place, started: a `PairSum` in host memory, an
    all-reduce on a device (gloo sends and receives host memory only; NCCL's all-reduce of
    two is one pass)."""
    if tensor.is_cpu:
        return RowSum(None, PairSum(group, tensor, rank, tag).wait)
    return RowSum(group.allreduce([tensor]), lambda: tensor)


def _background_sum_of_two(group: Any, tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """`_sum_of_two` on the background thread, waited for there."""
    return _sum_of_two(group, tensor, rank, BACKGROUND_TAG).wait()


def _background_ordered_sum(group: Any, tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """`ordered_sum` on the background thread, with its tags."""
    return ordered_sum(group, tensor, rank, world_size, BACKGROUND_TAG)


class OrderedSum:
    """The elementwise sum of `tensor` over the group's T ranks, added in rank order, into a
    new tensor shaped like it: started here, finished by `wait()`. Host memory (gloo's send
    and recv); `tensor` must not change until `wait()` returns.

    The flat buffer is cut into T chunks. Every rank sends its chunk r to rank r, which adds
    the T copies in rank order as they arrive and sends the folded chunk to every rank. Each
    rank receives T - 1 chunks twice: 2 (T - 1) / T of the buffer, what a ring all-reduce
    receives, where gathering every buffer would take T - 1 of them.

    Every message is posted at once, each rank's gathered chunks received where they belong
    in the result: gloo's all-to-all exchanges with one peer after another, and two of them
    took 1.0-2.7x the time of an all-reduce for 32k rows of 16 floats at T = 3-8, against
    0.7-1.45x this way (docs/design.md, "Embedding sync"). Messages of one tag pair up in the
    order they were sent, so the sums a thread starts on a group must be waited for in the
    order they were started (every rank starting them in the same order)."""

    def __init__(self, group: Any, tensor: torch.Tensor, rank: int, world_size: int, tag: int) -> None:
        flat = tensor.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        n = flat.numel()
        chunk = -(-n // world_size)
        spans = [(min(r * chunk, n), min((r + 1) * chunk, n)) for r in range(world_size)]
        scatter, gather = _ordered_tags(tag)
        peers = [r for r in range(world_size) if r != rank]
        begin, end = spans[rank]
        self._shape, self._rank = tensor.shape, rank
        self._own = flat[begin:end]
        self._out = torch.empty(n, dtype=flat.dtype, device=flat.device)
        self._folded = self._out[begin:end]
        copies = torch.empty(len(peers), end - begin, dtype=flat.dtype, device=flat.device)
        self._copies = dict(zip(peers, copies, strict=True))
        self._arrivals = {r: group.recv([self._copies[r]], r, scatter) for r in peers if end > begin}
        # a rank whose chunk is empty (fewer elements than ranks) sends and receives none of it
        others = [(r, *spans[r]) for r in peers if spans[r][0] < spans[r][1]]
        self._gathered = [group.recv([self._out[b:e]], r, gather) for r, b, e in others]
        self._sent = [group.send([flat[b:e]], r, scatter) for r, b, e in others]
        self._group, self._peers, self._gather_tag = group, peers, gather
        self._done = False

    def wait(self) -> torch.Tensor:
        """The sum; the first call finishes it (a gloo request may be waited for once),
        later ones return it again."""
        if self._done:
            return self._out.view(self._shape)
        self._done = True
        if len(self._folded):
            parts = [self._part(r) for r in range(2)]
            torch.add(parts[0], parts[1], out=self._folded)
            for r in range(2, len(self._peers) + 1):
                self._folded.add_(self._part(r))
            self._sent += [self._group.send([self._folded], r, self._gather_tag) for r in self._peers]
        for work in self._gathered + self._sent:
            work.wait()
        return self._out.view(self._shape)

    def _part(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s copy of this rank's chunk, once it has arrived."""
        if rank == self._rank:
            return self._own
        self._arrivals[rank].wait()
        return self._copies[rank]


def _ordered_tags(tag: int) -> tuple[int, int]:
    """The tags of an `OrderedSum`'s scattered chunks and gathered ones, for a thread's tag:
    apart from each other and from every thread's `PairSum`."""
    return 16 + 2 * tag, 17 + 2 * tag


def ordered_sum(group: Any, tensor: torch.Tensor, rank: int, world_size: int, tag: int = TRAINING_THREAD_TAG) -> torch.Tensor:
    """The elementwise sum of `tensor` over the group's T > 2 ranks, added in rank order, as
    a new tensor shaped like it (blocking): an `OrderedSum` in host memory, two all-to-alls
    on a device (`ordered_sum_by_all_to_all`; NCCL's all-to-all is one call)."""
    if tensor.is_cpu:
        return OrderedSum(group, tensor, rank, world_size, tag).wait()
    return ordered_sum_by_all_to_all(group, tensor, rank, world_size)


def ordered_sum_by_all_to_all(group: Any, tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """`OrderedSum`'s chunks, folds and bits by two all-to-alls (blocking): for tensors on a
    device, where gloo's send and recv take host memory only."""
    flat = tensor.reshape(-1).contiguous()
    n = flat.numel()
    chunk = -(-n // world_size)
    sizes = [max(0, min(chunk, n - r * chunk)) for r in range(world_size)]
    mine = sizes[rank]
    received = torch.empty(world_size * mine, dtype=flat.dtype, device=flat.device)
    group.alltoall_base(received, flat, [mine] * world_size, sizes).wait()
    folded = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
    copies = received.view(world_size, mine)
    folded[:mine] = copies[0]
    for r in range(1, world_size):
        folded[:mine].add_(copies[r])
    gathered = torch.empty(world_size * chunk, dtype=flat.dtype, device=flat.device)
    group.alltoall_base(gathered, folded.repeat(world_size), [chunk] * world_size, [chunk] * world_size).wait()
    return gathered[:n].view(tensor.shape)


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the trainers' group meets: a TCPStore at `store` that another process hosts
    (the coordinator), keys under `prefix` (a restart's fresh group); or, with `hosted`,
    the store is started by rank 0 at `store` (`tcp://`); `torchrun` reads torchrun's
    MASTER_ADDR/MASTER_PORT instead."""

    store: Endpoint
    prefix: str = ""
    hosted: bool = False
    torchrun: bool = False


def init_collectives(
    backend: str, rendezvous: Rendezvous, rank: int, world_size: int, timeout_s: float
) -> Collectives:
    """Join the trainers' process group, its gloo sockets on the interface that reaches the
    peers (`gloo_interface`)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        gloo_interface(rendezvous.store.host)
    if rendezvous.torchrun:
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout)
    elif rendezvous.hosted:
        dist.init_process_group(backend=backend, init_method=f"tcp://{rendezvous.store}", rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        store = dist.TCPStore(rendezvous.store.host, rendezvous.store.port, world_size, is_master=False,
                              timeout=timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(rendezvous.prefix, store), rank=rank,
                                world_size=world_size, timeout=timeout)
    background = dist.new_group(backend=backend) if world_size > 1 else None
    calm_gloo_loops()
    return Collectives(world_size=world_size, rank=rank, group=dist.group.WORLD, background=background)


#: The name gloo gives the thread that runs a device's TCP event loop (one per process group).
GLOO_LOOP_THREAD = "gloo_tcp_loop"


def calm_gloo_loops() -> list[int]:
    """Put this process's gloo event-loop threads under SCHED_BATCH, so that data arriving
    for them never preempts a running thread of ours; returns their thread ids. Call it once
    the process groups exist (gloo starts a group's loop thread with the group), and again
    after making more.

    Why: the loop handles a connection's events only if it takes the connection's lock
    without waiting (`Pair::handleEvents`, `try_to_lock`); otherwise it is back in
    `epoll_wait`, which returns at once while the socket stays readable. A send holds that
    lock while it writes its whole message. When the peer's answer wakes the loop thread
    just as a send of ours has written, the loop preempts the sender, still holding the
    lock, and spins until the scheduler's tick: 1.4 to 4 ms and 1,000 to 3,000 calls at a
    time, seen with `perf` on a pinned trainer at T = 2, where the loop thread spent 4.2 us
    of CPU per sample, nearly all in that spin. A SCHED_BATCH thread does not preempt on
    wake-up; the sender runs on, lets go of the lock, and the loop reads when the core is
    free: 1.4 us per sample (docs/design.md, "Threads of a trainer"). Where the policy does
    not exist (not Linux) this does nothing."""
    if not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"):
        return []
    calmed = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() != GLOO_LOOP_THREAD:
                    continue
            os.sched_setscheduler(int(task), os.SCHED_BATCH, os.sched_param(0))
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            continue
        except PermissionError as exc:  # a sandbox that forbids it (seccomp): slower, still correct
            log.warning("gloo's loop threads keep their scheduling policy: SCHED_BATCH is forbidden here (%s)", exc)
            return calmed
        calmed.append(int(task))
    return calmed


#: What gloo (and NCCL) say when a peer does not answer or its connection breaks.
_PEER_FAILURES = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe",
                  "connection refused", "no route to host", "invalid argument", "read error", "write error")


def peers_unreachable(exc: BaseException, rank: int, world_size: int, timeout_s: float) -> Unavailable | None:
    """The clear error for a collective that failed because the other trainers could not be
    reached (a partition between trainer hosts, a trainer that died), or None for any other
    failure. gloo's own message names no peer and no setting; this one names both."""
    if world_size < 2 or not isinstance(exc, RuntimeError):
        return None
    detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if not any(sign in detail.lower() for sign in _PEER_FAILURES):
        return None
    others = ", ".join(str(r) for r in range(world_size) if r != rank)
    return Unavailable(
        f"trainer {rank}: a collective with trainer{'s' if world_size > 2 else ''} {others} failed "
        f"(they did not answer within {timeout_s:g} s, 4 x cluster.request_timeout_s, or their connection "
        f"broke): the trainers must reach each other directly, and each must be alive; gloo said: {detail[:200]}",
        trainer=rank, peers=[r for r in range(world_size) if r != rank], timeout_s=timeout_s,
    )


def gloo_interface(peer_host: str) -> str | None:
    """Point gloo at the network interface on the route to `peer_host`, unless
    $GLOO_SOCKET_IFNAME already names one (the explicit override); the interface, or None
    for loopback peers.

    Left alone, gloo binds the address the hostname resolves to, often 127.0.0.1, and
    trainers on other hosts are then refused ("Gloo connectFullMesh failed").
    """
    if os.environ.get(GLOO_IFNAME):
        return os.environ[GLOO_IFNAME]
    address = address_towards(peer_host)
    if ipaddress.ip_address(address).is_loopback:
        return None
    name = interface_of(address)
    if name is not None:
        os.environ[GLOO_IFNAME] = name
    return name


def interface_of(address: str) -> str | None:
    """The name of the local IPv4 interface holding `address`, if any."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                request = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # down, or no IPv4 address
                continue
        if socket.inet_ntoa(answer[20:24]) == address:
            return name
    return None


def close_collectives() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
