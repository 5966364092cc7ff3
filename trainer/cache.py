"""The trainer's embedding cache: a ``[C, d]`` row tensor and its ``[C, s]`` optimizer state.

Pure tensor code: slots come from the oracle's directives (no hashing here) and rows come
from whoever holds them (the PS client, a join collective). On CUDA, rows arriving from the
host are staged in pinned memory and copied on the side stream (DESIGN §5).
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.device import Device
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
        return torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device.torch_device)

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows and state at `slots`."""
        idx = self.index(slots)
        return self.rows[idx], self.state[idx]

    def read_host(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies on the host as numpy, for write-backs."""
        rows, state = self.read(slots)
        return rows.cpu().numpy(), state.cpu().numpy()

    def write(self, slots: np.ndarray, rows: torch.Tensor, state: torch.Tensor) -> None:
        idx = self.index(slots)
        self.rows[idx] = rows
        self.state[idx] = state

    def write_host(self, slots: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Insert rows that arrived on the host (staged and copied on the side stream on CUDA)."""
        dev = self.device
        host_rows = dev.stage(torch.from_numpy(np.ascontiguousarray(rows)))
        host_state = dev.stage(torch.from_numpy(np.ascontiguousarray(state)))
        with dev.on_copy_stream():
            rows_t = host_rows.to(dev.torch_device, non_blocking=True)
            state_t = host_state.to(dev.torch_device, non_blocking=True)
            copied = dev.event()
            copied.record()
        dev.compute_waits_for(copied)
        self.write(slots, rows_t, state_t)

    def apply(self, slots: np.ndarray, grad: torch.Tensor) -> None:
        """One optimizer step on the rows at unique `slots` with their combined gradient."""
        if len(slots):
            self.optimizer.step_at(self.rows, self.state, self.index(slots), grad)
