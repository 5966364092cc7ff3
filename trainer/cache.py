"""The trainer's embedding cache: a ``[C, d]`` row tensor and its ``[C, s]`` optimizer state.

Pure tensor code: slots come from the oracle's directives (no hashing here) and rows come
from whoever holds them (the PS client, a join collective). Fetched rows arrive already on
the device (`trainer.device.Device.stage`: on CUDA copied on the side stream as soon as they
arrived), so inserting them only waits for their copy (docs/design.md#cache-and-overlap).
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.device import Device, Staged
from trainer.kernels import gather_rows, scatter_rows
from trainer.optim import EmbeddingOptimizer


class EmbeddingCache:
    def __init__(self, capacity: int, dim: int, optimizer: EmbeddingOptimizer, device: Device) -> None:
        self.device = device
        self.optimizer = optimizer
        self.rows = torch.zeros(capacity, dim, dtype=torch.float32, device=device.torch_device)
        self.state = optimizer.initial_state(capacity).to(device.torch_device)

    @property
    def dim(self) -> int:
        return self.rows.shape[1]

    @property
    def state_width(self) -> int:
        return self.state.shape[1]

    def index(self, slots: np.ndarray) -> torch.Tensor:
        return self.device.upload(np.asarray(slots, dtype=np.int64))

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows and state at `slots`."""
        idx = self.index(slots)
        return self.rows.index_select(0, idx), self.state.index_select(0, idx)

    def read_host(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies on the host as numpy, for write-backs."""
        if not self.device.is_cuda:
            rows = np.empty((len(slots), self.dim), np.float32)
            state = np.empty((len(slots), self.state_width), np.float32)
            gather_rows(self.rows.numpy(), self.state.numpy(), _indices(slots), rows, state)
            return rows, state
        rows, state = self.read(slots)
        return rows.cpu().numpy(), state.cpu().numpy()

    def write(self, slots: np.ndarray, rows: torch.Tensor, state: torch.Tensor) -> None:
        if not self.device.is_cuda:  # one pass over both tensors, without index_copy_'s dispatch
            # a join's rows are column views of its buffer: copied (a few hundred rows), so
            # that the kernel's copy loop is over contiguous rows and vectorizes
            scatter_rows(self.rows.numpy(), self.state.numpy(), _indices(slots),
                         np.ascontiguousarray(rows.numpy()), np.ascontiguousarray(state.numpy()))
            return
        idx = self.index(slots)
        self.rows.index_copy_(0, idx, rows)
        self.state.index_copy_(0, idx, state)

    def insert(self, slots: np.ndarray, staged: Staged) -> None:
        """Write rows staged by `Device.stage` into `slots`, once their copy is done."""
        self.device.wait_for(staged)
        self.write(slots, staged.rows, staged.state)

    def apply(self, slots: np.ndarray, grad: torch.Tensor, positions: np.ndarray | None = None, divisor: int = 1) -> None:
        """One optimizer step on the rows at unique `slots` with their combined gradient:
        ``grad[positions[i]] / divisor`` for ``slots[i]`` (``grad[i] / divisor`` without
        `positions`)."""
        if len(slots):
            at = None if positions is None else self.index(positions)
            self.optimizer.step_at(self.rows, self.state, self.index(slots), grad, positions=at, divisor=divisor)


def _indices(slots: np.ndarray) -> np.ndarray:
    """Slots as the kernels take them: int32 or int64, contiguous."""
    slots = np.ascontiguousarray(slots)
    return slots if slots.dtype in (np.int32, np.int64) else slots.astype(np.int64)
