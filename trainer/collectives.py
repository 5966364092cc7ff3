"""The trainers' process group and the two collectives the embedding sync needs.

Created once per process and passed around as an object (never a module global). With one
trainer every collective is the identity, so T = 1 runs the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.spec import Endpoint


class Work(Protocol):
    def wait(self) -> Any: ...


class RowSum:
    """A sum across trainers in flight; `wait()` returns it (a tensor like the one given)."""

    def __init__(self, work: Work | None, result: Callable[[], torch.Tensor]) -> None:
        self._work = work
        self._result = result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._result()


@dataclass(frozen=True)
class Collectives:
    """The trainers' process group. Data-plane collectives call the group object directly,
    so a group built in one process (launcher/inprocess.py) runs this code."""

    world_size: int
    rank: int
    group: Any  # torch.distributed.ProcessGroup

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` across trainers, in place, in the collective's own order: exact only
        where at most one trainer contributes a non-zero per element (joins)."""
        if self.world_size > 1 and tensor.numel():
            self.group.allreduce([tensor]).wait()

    def sum_rows(self, tensor: torch.Tensor) -> RowSum:
        """Start the sum of `tensor` across trainers, added in rank order for every element,
        whatever its position: ((g0 + g1) + g2) + ... . A ring all-reduce adds each chunk
        starting at a different rank, so the same row summed at two positions of a buffer
        could differ in its last bits, and modes lay their sync buffers out differently.

        Two trainers need no care (a + b = b + a); more gather every buffer (T times the
        bytes of one, against about twice for a ring all-reduce) and add them here.
        """
        if self.world_size == 1 or not tensor.numel():
            return RowSum(None, lambda: tensor)
        if self.world_size == 2:
            return RowSum(self.group.allreduce([tensor]), lambda: tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        return RowSum(self.group.allgather([parts], [tensor]), lambda: _sum_in_order(parts))

    def all_gather_objects(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def _sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0]
    for part in parts[1:]:
        total.add_(part)
    return total


def init_collectives(
    backend: str, rendezvous: Endpoint, rank: int, world_size: int, timeout_s: float
) -> Collectives:
    """Join the trainers' process group (TCP rendezvous at `rendezvous`)."""
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{rendezvous.host}:{rendezvous.port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return Collectives(world_size=world_size, rank=rank, group=dist.group.WORLD)


def close_collectives() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
