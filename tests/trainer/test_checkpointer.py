"""A trainer's part of checkpoints (`trainer.checkpointer.Checkpointer`), with the PS faked."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.errors import Unavailable
from trainer.checkpointer import Checkpointer
from trainer.io_thread import IoThread
from trainer.records import RecordWriter


class DownPs:
    async def report_checkpoint(self, *args: Any) -> list:
        raise Unavailable("PS shard 0 is down")


def test_a_checkpoint_that_fails_keeps_no_dense_state(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Rank 0 keeps each checkpoint's dense state (model and optimizer) until the checkpoint
    # completes; one that fails is never retried, so its state must go, not stay for the run.
    job = SimpleNamespace(spec=SimpleNamespace(trainers=SimpleNamespace(count=2)))
    model = torch.nn.Linear(4, 1)
    engine = SimpleNamespace(model=SimpleNamespace(module=model), dense_optimizer=torch.optim.Adagrad(model.parameters()))
    io, records = IoThread(), RecordWriter(tmp_path / "trainer-0.jsonl")
    try:
        checkpoints = Checkpointer(job, 0, io, DownPs(), None, records)  # type: ignore[arg-type]
        for c in (10, 20, 30):
            checkpoints.save_dense(c, engine)  # type: ignore[arg-type]
            checkpoints.report(c, [])
        checkpoints.wait()
    finally:
        io.close()
        records.close()
    assert checkpoints._dense == {}
    assert caplog.text.count("is incomplete: PS shard 0 is down") == 3
