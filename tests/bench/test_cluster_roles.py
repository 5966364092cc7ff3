"""bench/cluster.py's handle on a role's process: a role still running when a test's time is
up writes where it waits into its log (`Role.dump_stacks`, launch.py's SIGUSR1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.cluster import Role
from common.spec import TOKEN_ENV
from tests.cluster_helpers import write_spec
from tests.test_launch import LAUNCH, wait_for


def test_a_running_role_writes_its_stacks_into_its_log_and_goes_on(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "solo", {})
    ready, log_path = tmp_path / "ps-0.ready", tmp_path / "ps-0.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(LAUNCH), str(spec), "--role", "ps", "--index", "0", "--ready-file", str(ready)],
            env={**os.environ, TOKEN_ENV: "roles-test-token"}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=tmp_path,
        )
    role = Role(name="ps-0", process=process, log_path=log_path, ready_file=ready)
    try:
        wait_for(lambda: ready.exists() or process.poll() is not None, 60, "the PS ready file")
        assert role.dump_stacks()
        text = log_path.read_text()
        assert "Current thread" in text and "in run_role" in text.split("Current thread")[1], text[-3000:]
        assert process.poll() is None  # it goes on
    finally:
        process.terminate()
        process.wait(timeout=30)
