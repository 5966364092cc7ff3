"""Trainers under plain torchrun (``python -m torch.distributed.run ... launch.py --role trainer
--coordinator HOST:PORT``), beside an oracle started with the spec and PS shards that know
only the coordinator, as real processes on loopback.

Each trainer takes torchrun's RANK as its index and meets the others at torchrun's
rendezvous store, not the coordinator's; the run must end by itself, bit-identical to the
local launcher's run of the same spec.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster_helpers import TOKEN, differing_elements, final_model, run_spec, write_spec
from tests.test_coordinator import Roles
from tests.test_launch import LAUNCH

pytestmark = pytest.mark.slow
OVERRIDES = {"train": {"max_iterations": 20}, "cluster": {"reconnect_s": 5}}


def torchrun(roles: Roles, coordinator: str, run_dir: Path, logs: Path) -> subprocess.Popen:
    """Two trainers under one torchrun agent (c10d rendezvous on a free port), each
    worker's output in `logs`/<run id>/attempt_0/<local rank>/."""
    host = roles.tmp_path / "trainers"
    host.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "bagpipe-test",
        "--log-dir", str(logs), "--redirects", "3",
        str(LAUNCH), "--role", "trainer", "--coordinator", coordinator, "--run-dir", str(run_dir),
    ]
    with (roles.tmp_path / "torchrun.log").open("wb") as log:
        process = subprocess.Popen(command, cwd=host, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "BAGPIPE_TOKEN": TOKEN})
    roles.processes.append(process)
    return process


def worker_log(logs: Path, local_rank: int) -> str:
    (folder,) = logs.glob(f"*/attempt_0/{local_rank}")
    return "".join(path.read_text(errors="replace") for path in sorted(folder.glob("*.log")))


def test_trainers_under_torchrun_train_the_same_model(tmp_path: Path) -> None:
    oracle_host = tmp_path / "oracle-host"
    oracle_host.mkdir()
    spec = write_spec(oracle_host, "torchrun", OVERRIDES)
    job, _ = run_spec(spec, tmp_path / "launched")
    want = final_model(job, tmp_path / "launched")
    shutil.rmtree(job.spec.checkpoint.dir)

    roles = Roles(tmp_path)
    try:
        coordinator = roles.oracle(spec)
        shards = [roles.start(f"ps-{i}", "--role", "ps", "--coordinator", coordinator) for i in range(2)]
        run_dir, logs = tmp_path / "torchrun-run", tmp_path / "torchrun-logs"
        trainers = torchrun(roles, coordinator, run_dir, logs)
        assert trainers.wait(timeout=240) == 0, (tmp_path / "torchrun.log").read_text(errors="replace")
        for name, process in [*((f"ps-{i}", p) for i, p in enumerate(shards)), ("oracle", roles.processes[0])]:
            assert process.wait(timeout=60) == 0, roles.log(name)  # every role ends by itself
    finally:
        roles.kill_all()
    for rank in range(2):  # one node: torchrun's RANK is the local rank
        log = worker_log(logs, rank)
        assert f"trainer[{rank}]" in log and f"trainer[{1 - rank}]" not in log, log
    assert "every trainer has finished: the oracle exits" in roles.log("oracle")
    assert differing_elements(final_model(job, run_dir), want) == {}
