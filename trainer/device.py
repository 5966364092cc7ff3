"""The compute device, and rows copied to it as soon as they arrive from the network.

On CUDA, a fetched row block is copied host-to-device the moment its fetch completes, on
the I/O thread: into a reused pinned staging buffer, then on a side stream, with an event
recorded after the copy (docs/design.md#cache-and-overlap). The insertion before forward only makes the compute
stream wait for that event, so the copy overlaps whatever the GPU is computing meanwhile.
On the CPU the same calls are no-ops (`torch.cuda.Stream()` raises on a CPU build, hence the
stand-ins), so the trainer has one code path.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from common.errors import ConfigError


class Event(Protocol):
    def query(self) -> bool: ...


class _NoEvent:
    def query(self) -> bool:
        return True


class _NoStream:
    """The CPU has no side stream; `Device.stage` never enters one there."""


@dataclass(frozen=True)
class Staged:
    """Rows and optimizer state on the device; on CUDA still being copied until `copied`."""

    rows: torch.Tensor
    state: torch.Tensor
    copied: Any  # torch.cuda.Event, or a stand-in that is always done


#: Bytes of free staging buffers a pool keeps for reuse; beyond it, the largest go back to
#: the allocator (pinned memory is the host's to share: a burst must not keep it forever).
POOL_KEEP_BYTES = 256 << 20


class StagingPool:
    """Host buffers reused for host-to-device copies (pinned on CUDA: pinning is slow, and
    only pinned memory copies asynchronously). A buffer is handed out again only once the
    event of the copy that last read it has completed; the smallest that fits is chosen, and
    at most `keep_bytes` of buffers stay pooled."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], keep_bytes: int = POOL_KEEP_BYTES) -> None:
        self._allocate = allocate
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()  # fetches may complete on more than one thread
        self._buffers: list[tuple[torch.Tensor, Event]] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes`, free for writing; `give_back` it with the
        event of the copy that reads it."""
        with self._lock:
            fits = [(buf.numel(), i) for i, (buf, event) in enumerate(self._buffers) if buf.numel() >= nbytes and event.query()]
            if fits:
                return self._buffers.pop(min(fits)[1])[0]
        return self._allocate(1 << max(nbytes - 1, 1).bit_length())  # a power of two: reusable

    def give_back(self, buffer: torch.Tensor, event: Event) -> None:
        with self._lock:
            self._buffers.append((buffer, event))
            self._buffers.sort(key=lambda held: held[0].numel())
            while sum(buf.numel() for buf, _ in self._buffers) > self._keep_bytes and len(self._buffers) > 1:
                self._buffers.pop()  # the largest: freed once nothing refers to it

    def __len__(self) -> int:
        return len(self._buffers)


@dataclass(frozen=True)
class Device:
    """Device plus the copy stream, and the staging of rows that arrive from the network."""

    torch_device: torch.device
    copy_stream: Any
    pool: StagingPool = field(default_factory=lambda: StagingPool(_host_buffer), compare=False)

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def stage(self, rows: np.ndarray, state: np.ndarray) -> Staged:
        """Start copying `rows` and `state` to the device (on CUDA: pinned buffer, side
        stream, event); callable from any thread."""
        if not self.is_cuda:
            return Staged(torch.from_numpy(np.ascontiguousarray(rows)), torch.from_numpy(np.ascontiguousarray(state)), _NoEvent())
        with torch.cuda.device(self.torch_device), torch.cuda.stream(self.copy_stream):
            host = self.pool.take(rows.nbytes + state.nbytes)
            host_rows = _view(host, 0, rows)
            host_state = _view(host, rows.nbytes, state)
            on_device = (host_rows.to(self.torch_device, non_blocking=True),
                         host_state.to(self.torch_device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        self.pool.give_back(host, copied)
        return Staged(*on_device, copied)

    def stage_when_done(self, fetch: concurrent.futures.Future) -> concurrent.futures.Future:
        """A future of the `Staged` rows of `fetch` (whose result has `.rows` and `.state`),
        staged by whichever thread completes the fetch: the copy starts on arrival."""
        staged: concurrent.futures.Future = concurrent.futures.Future()

        def on_done(done: concurrent.futures.Future) -> None:
            try:
                got = done.result()
                staged.set_result(self.stage(got.rows, got.state))
            except BaseException as exc:  # handed to whoever waits for the rows
                staged.set_exception(exc)

        fetch.add_done_callback(on_done)
        return staged

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """`array` (indices, a batch's features) as a tensor on the device. On CUDA through
        pinned memory and without blocking: a copy from pageable memory would make the host
        wait for the stream each time, several times an iteration. The caching host allocator
        keeps the pinned copy until the transfer has read it."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if not self.is_cuda:
            return tensor
        return tensor.pin_memory().to(self.torch_device, non_blocking=True)

    def synchronize(self) -> None:
        """Wait for the compute stream (on CUDA), so that a phase timed on the host includes
        the device's work it launched, not only the launches."""
        if self.is_cuda:
            torch.cuda.current_stream(self.torch_device).synchronize()

    def wait_for(self, staged: Staged) -> None:
        """Make the compute stream wait for `staged`'s copy and own its memory from now on."""
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.torch_device)
            compute.wait_event(staged.copied)
            # Allocated on the copy stream: without this the allocator could hand the
            # memory to the next copy while the compute stream still reads it.
            staged.rows.record_stream(compute)
            staged.state.record_stream(compute)


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _view(buffer: torch.Tensor, offset: int, array: np.ndarray) -> torch.Tensor:
    """`array` copied into `buffer` at byte `offset`, as a float32 tensor of its shape."""
    part = buffer[offset : offset + array.nbytes].view(torch.float32).view(array.shape)
    part.numpy()[...] = array
    return part


def select_device(kind: Literal["auto", "cpu", "cuda"], local_rank: int) -> Device:
    """CUDA device `local_rank` where asked for (or available under "auto"), else the CPU."""
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainers.device", "cuda requested but torch sees no CUDA device")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        deterministic_kernels()
        torch.cuda.set_device(dev)
        return Device(dev, torch.cuda.Stream(dev))
    return Device(torch.device("cpu"), _NoStream())


#: cuBLAS's deterministic workspace setting; read when its first handle is made, so it is
#: set before any CUDA work.
CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def deterministic_kernels() -> None:
    """Make torch pick deterministic CUDA kernels: the backward of `index_select` (the rows a
    batch reads) would otherwise add a hot row's gradients with atomics, in any order, and
    modes would no longer be bit-identical. cuBLAS needs a fixed workspace for it (without
    one the first matmul raises)."""
    name, value = CUBLAS_WORKSPACE
    os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
