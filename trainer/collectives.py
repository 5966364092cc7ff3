"""The trainers' process group and the two collectives the embedding sync needs.

Created once per process and passed around as an object (never a module global). With one
trainer every collective is the identity, so T = 1 runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.spec import Endpoint


class Work(Protocol):
    def wait(self) -> Any: ...


class _Done:
    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class Collectives:
    world_size: int
    rank: int
    group: Any

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` across trainers, in place; every trainer ends with the same bits."""
        if self.world_size > 1 and tensor.numel():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_async(self, tensor: torch.Tensor) -> Work:
        """Start a sum across trainers; `wait()` on the result before reading `tensor`."""
        if self.world_size > 1 and tensor.numel():
            return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Done()

    def all_gather_objects(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


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
