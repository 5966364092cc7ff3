"""Which cores the local launcher gives each trainer (`--cpus`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.job import build_job
from common.runtime import trainer_cpus
from common.spec import load_spec
from launcher.cluster import LocalCluster
from tests.cluster_helpers import TOKEN, write_spec


@pytest.mark.parametrize("pin", [True, False])
def test_each_trainer_is_given_its_share_of_the_cores_unless_told_not_to(tmp_path: Path, pin: bool) -> None:
    job = build_job(load_spec(write_spec(tmp_path, "cpus", {"trainers": {"count": 2, "pin_cpus": pin}})))
    cluster = LocalCluster(job, tmp_path / "run", token=TOKEN)
    for rank in range(2):
        share = trainer_cpus(os.sched_getaffinity(0), 2, 1, rank)
        expected = [] if not pin or share is None else ["--cpus", ",".join(map(str, share))]
        assert cluster._cpus(rank) == expected
    if pin and len(os.sched_getaffinity(0)) >= 2:  # two cores or more: two disjoint shares
        first, second = (set(cluster._cpus(r)[1].split(",")) for r in range(2))
        assert first and second and not first & second
