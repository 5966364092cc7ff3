"""A run across hosts (`bench/topology.py`: one network namespace per role, every link
shaped to 1 Gbit/s), each role started as across machines (`bench/cluster.start_roles`: the
spec on the oracle's host only), against the same run in one process (bit-identical to it on
loopback): bit-identical, although a PS host's link is cut for a while in the middle of it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.cluster import HOSTS, start_roles
from bench.topology import HostSpec, Topology
from tests.bench.test_topology import needs_namespaces
from common.job import build_job
from common.spec import load_spec
from launcher.inprocess import run_in_process
from tests.cluster_helpers import differing_elements, final_model, write_spec
from tests.test_launch import wait_for
from trainer.records import IterationRecord, read_records, trainer_log_path

pytestmark = [pytest.mark.slow, needs_namespaces]
ITERATIONS = 240
CUT_AT = 40  # the iteration after which ps1's link goes down
CUT_S = 3.0  # for this long: well within the trainers' reconnect_s


def iteration_times(run_dir: Path) -> list[float]:
    path = trainer_log_path(run_dir, 0)
    if not path.exists():
        return []
    return [r.time for r in read_records(path) if isinstance(r, IterationRecord)]


def iterations_done(run_dir: Path) -> int:
    return len(iteration_times(run_dir))


def test_a_run_across_hosts_is_bit_identical_and_survives_a_cut_ps_link(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"  # hidden on every host but the oracle's
    job_dir.mkdir()
    data = {"format": "synthetic", "rows": 9000, "table_sizes": [50, 200, 1000, 5000], "num_dense": 4,
            "top1_share": 0.5, "eval_fraction": 0.1, "seed": 1}
    spec = write_spec(job_dir, "hosts", {"train": {"batch_size": 32, "max_iterations": ITERATIONS},
                                         "checkpoint": {"dir": str(tmp_path / "checkpoints")}}, data=data)
    job = build_job(load_spec(spec))
    want = run_in_process(job).model  # a loopback cluster's very bits (tests/trainer/test_cluster.py)

    hosts = [HostSpec(name=h, rate="1gbit", hide_data=(job_dir,) if h != "oracle" else ()) for h in HOSTS]
    run_dir = tmp_path / "hosts"
    (run_dir / "logs").mkdir(parents=True)
    with Topology(hosts) as net:
        roles = start_roles(net, spec, run_dir, port=7000)
        wait_for(lambda: iterations_done(run_dir) >= CUT_AT, 180, f"{CUT_AT} iterations")
        net["ps1"].set_link(up=False)
        assert iterations_done(run_dir) < ITERATIONS, "the run ended before the cut"
        time.sleep(CUT_S)  # the outage itself
        net["ps1"].set_link(up=True)
        for role in roles:
            assert role.process.wait(timeout=300) == 0, role.failure()
    times = iteration_times(run_dir)
    assert len(times) == ITERATIONS
    # The cut held training up (a trainer cannot go prefetch_lead iterations without the PS):
    # it was survived, not missed.
    assert max(b - a for a, b in zip(times, times[1:])) > CUT_S / 2
    assert differing_elements(final_model(job, run_dir), want) == {}
