"""A run whose checkpoint disk fills up, then a resume once space is freed.

Run by tests/test_recovery.py inside its own mount namespace (``unshare --mount
--map-root-user``, no root needed where user namespaces are allowed), so that the checkpoint
folder can be a small real tmpfs that every role of the local cluster sees:

    python -m tests.full_disk SPEC OUT

It mounts the tmpfs on the spec's checkpoint folder, runs the cluster and fills the disk as
soon as the first checkpoint is complete, deletes the filler, resumes from the latest
complete checkpoint, and leaves in OUT what the test checks: facts.json and the resumed
run's final model (the tables live on the tmpfs, which is gone once this process ends).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import torch

from common.checkpoints import latest_complete
from common.job import build_job
from common.spec import load_spec
from launcher.cluster import LocalCluster, run_cluster
from tests.cluster_helpers import TOKEN, final_model

TMPFS_SIZE = "16m"


class FillDiskOnce:
    """on_poll hook: once a checkpoint is complete, take every free byte of the disk."""

    def __init__(self, directory: Path, num_shards: int) -> None:
        self.directory, self.num_shards = directory, num_shards
        self.filler = directory / "filler"
        self.filled = False

    def __call__(self, cluster: LocalCluster) -> None:
        if self.filled or latest_complete(self.directory, self.num_shards) is None:
            return
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o644)
        chunk = bytes(1 << 20)
        try:
            while True:
                os.write(fd, chunk)  # a partial write on the last free pages, then ENOSPC
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        self.filled = True


def main(spec_path: Path, out: Path) -> None:
    job = build_job(load_spec(spec_path))
    directory = job.spec.checkpoint.dir
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(directory)], check=True)
    fill = FillDiskOnce(directory, job.spec.ps.num_shards)
    full = run_cluster(job, out / "full", token=TOKEN, on_poll=fill)
    latest = latest_complete(directory, job.spec.ps.num_shards)
    fill.filler.unlink()
    resumed = run_cluster(job, out / "resumed", token=TOKEN, resume=True)
    model = final_model(job, resumed.run_dir)
    torch.save(model.dense, out / "dense.pt")
    np.savez(out / "tables.npz", table=model.table, state=model.state)
    facts = {"filled": fill.filled, "latest_on_full_disk": latest, "restarts": len(full.restarts) + len(resumed.restarts)}
    (out / "facts.json").write_bytes(orjson.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
