"""The compute device and its copy streams, chosen once at start-up.

On CUDA, staged rows are copied host-to-device on a side stream from pinned memory and the
compute stream waits on an event (DESIGN §5). On the CPU the same calls are no-ops, so the
trainer has one code path: `torch.cuda.Stream()` raises on a CPU build, hence the stand-ins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from common.errors import ConfigError


class _NoEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NoStream:
    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class Device:
    """Device plus the copy-stream operations the cache needs."""

    torch_device: torch.device
    copy_stream: Any

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        """Pinned host copy of `host` on CUDA (so the H2D copy can be asynchronous)."""
        return host.pin_memory() if self.is_cuda else host

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        if self.is_cuda:
            with torch.cuda.stream(self.copy_stream):
                yield
        else:
            yield

    def event(self) -> Any:
        return torch.cuda.Event() if self.is_cuda else _NoEvent()

    def compute_waits_for(self, event: Any) -> None:
        """Make the compute stream wait for work recorded on the copy stream."""
        if self.is_cuda:
            torch.cuda.current_stream(self.torch_device).wait_event(event)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)


def select_device(kind: Literal["auto", "cpu", "cuda"], local_rank: int) -> Device:
    """CUDA device `local_rank` where asked for (or available under "auto"), else the CPU."""
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainers.device", "cuda requested but torch sees no CUDA device")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return Device(dev, torch.cuda.Stream(dev))
    return Device(torch.device("cpu"), _NoStream())
