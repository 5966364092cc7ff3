"""Runs across hosts (`bench/topology.py`: one network namespace per role, every link shaped
to 1 Gbit/s), each role started as across machines (`bench/cluster.start_roles`: the spec on
the oracle's host only), against the same run in one process (bit-identical to it on
loopback), with the links failing as `bench/faults.py` makes them: a PS host's link down for
a while (the run stalls, goes on, and ends bit-identical), one shard's link slowed to
1 Mbit/s (slower, bit-identical), the trainers cut from each other while the PS and the
oracle stay reachable (a clear error naming the trainers within the collectives' timeout,
never a hang)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.cluster import HOSTS, Role, start_roles
from bench.faults import Fault, FaultInjector, LinkDown, Partition, SlowLink, shaped
from bench.topology import HostSpec, Topology
from common.job import Job, build_job
from common.spec import load_spec
from launcher.inprocess import run_in_process
from tests.bench.test_topology import needs_namespaces
from tests.cluster_helpers import differing_elements, final_model, write_spec
from trainer.records import IterationRecord, RunTail, read_records, trainer_log_path

pytestmark = [pytest.mark.slow, needs_namespaces]
DATA = {"format": "synthetic", "rows": 9000, "table_sizes": [50, 200, 1000, 5000], "num_dense": 4,
        "top1_share": 0.5, "eval_fraction": 0.1, "seed": 1}


def iteration_times(run_dir: Path, trainer: int = 0) -> list[float]:
    path = trainer_log_path(run_dir, trainer)
    if not path.exists():
        return []
    return [r.time for r in read_records(path) if isinstance(r, IterationRecord)]


def job_across_hosts(tmp_path: Path, iterations: int, cluster: dict[str, Any] | None = None) -> tuple[Job, Path]:
    """The job and its spec, in a folder hidden on every host but the oracle's."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    overrides: dict[str, Any] = {"train": {"batch_size": 32, "max_iterations": iterations},
                                 "checkpoint": {"dir": str(tmp_path / "checkpoints")}}
    if cluster:
        overrides["cluster"] = cluster
    spec = write_spec(job_dir, "hosts", overrides, data=DATA)
    return build_job(load_spec(spec)), spec


def run_with_faults(tmp_path: Path, spec: Path, faults: Sequence[Fault], *, until_s: float = 300) -> tuple[
        Path, list[Role], FaultInjector, dict[str, int | None]]:
    """Start every role on its host, fire `faults` as the trainers get to them, and wait (at
    most `until_s`) until every role has exited; each role's exit code (None: still running
    when the time was up)."""
    hosts = shaped([HostSpec(name=h, rate="1gbit", hide_data=(spec.parent,) if h != "oracle" else ())
                    for h in HOSTS], faults)
    run_dir = tmp_path / "hosts"
    (run_dir / "logs").mkdir(parents=True)
    with Topology(hosts) as net:
        roles = start_roles(net, spec, run_dir, port=7000)
        faults_in = FaultInjector(net, faults)
        deadline = time.monotonic() + until_s
        trainers = [r for r in roles if r.name.startswith("trainer-")]
        tail, done = RunTail(run_dir, len(trainers)), [0] * len(trainers)  # new records only, each poll
        while time.monotonic() < deadline and not all(r.process.poll() is not None for r in trainers):
            for j, records in tail.poll().items():
                done[j] += sum(isinstance(r, IterationRecord) for r in records)
            faults_in.poll(min(done))
            time.sleep(0.05)  # a poll interval: what it waits for is in the records and exit codes
        faults_in.heal()
        codes = {r.name: r.process.poll() for r in trainers}
        for role in trainers:  # still running when the time was up: where it waits, into its log
            if codes[role.name] is None:
                role.dump_stacks()
        if all(code == 0 for code in codes.values()):  # the services exit by themselves once trainers have
            for role in roles:
                codes[role.name] = role.process.wait(timeout=60)
    return run_dir, roles, faults_in, codes


ITERATIONS = 240
CUT_AT = 40  # the iteration after which ps1's link goes down


@pytest.mark.parametrize("cut_s", [10.0, pytest.param(60.0, marks=pytest.mark.nightly)], ids=["10s", "60s"])
def test_a_run_across_hosts_is_bit_identical_and_survives_a_cut_ps_link(tmp_path: Path, cut_s: float) -> None:
    # Everything that waits for the PS outlasts the cut: its clients' reconnect budget, the
    # shards' watch of the coordinator, a fetch's wait, the trainers' collectives (4 x the
    # default request_timeout_s, 30 s). A request in flight when the link went down does
    # not: its connection is dropped after 10 s unacknowledged (common/transport/links.py)
    # and the request retried on a new one.
    cluster = {"reconnect_s": 2 * cut_s + 30, "fetch_timeout_s": 2 * cut_s + 60}
    job, spec = job_across_hosts(tmp_path, ITERATIONS, cluster)
    want = run_in_process(job).model  # a loopback cluster's very bits (tests/trainer/test_cluster.py)
    run_dir, roles, faults, codes = run_with_faults(tmp_path, spec, [LinkDown(host="ps1", after=CUT_AT, seconds=cut_s)],
                                                    until_s=600)
    assert all(code == 0 for code in codes.values()), [r.failure() for r in roles if codes.get(r.name, 0) != 0]
    assert len(faults.fired) == 1, "the run ended before the cut"
    times = iteration_times(run_dir)
    assert len(times) == ITERATIONS
    # The cut held training up (a trainer cannot go prefetch_lead iterations without the PS):
    # it was survived, not missed.
    assert max(b - a for a, b in zip(times, times[1:])) > cut_s / 2
    assert differing_elements(final_model(job, run_dir), want) == {}


def test_a_shard_on_a_slow_link_slows_the_run_and_it_ends_bit_identical(tmp_path: Path) -> None:
    """ps1's link at 1 Mbit/s, every other at 1 Gbit/s: the trainers wait for its rows and
    write-backs, nothing times out, nothing differs."""
    job, spec = job_across_hosts(tmp_path, 120)
    want = run_in_process(job).model
    run_dir, roles, _, codes = run_with_faults(tmp_path, spec, [SlowLink(host="ps1", rate="1mbit")], until_s=600)
    assert all(code == 0 for code in codes.values()), [r.failure() for r in roles if codes.get(r.name, 0) != 0]
    assert len(iteration_times(run_dir)) == 120
    assert differing_elements(final_model(job, run_dir), want) == {}


def test_trainers_whose_link_to_each_other_is_cut_fail_naming_each_other_within_the_timeout(tmp_path: Path) -> None:
    """tr0 and tr1 cannot reach each other from iteration 20 on; both still reach the PS and
    the oracle. Each trainer exits with one line naming the other and the timeout that ran
    out (4 x request_timeout_s), instead of hanging in gloo."""
    request_timeout_s = 5.0
    job, spec = job_across_hosts(tmp_path, 400, {"request_timeout_s": request_timeout_s})
    started = time.monotonic()
    run_dir, roles, faults, codes = run_with_faults(tmp_path, spec, [Partition(hosts=("tr0", "tr1"), after=20)],
                                                    until_s=240)
    assert len(faults.fired) == 1, "the run ended before the partition"
    assert len(iteration_times(run_dir)) < 400
    for j in range(2):
        assert codes[f"trainer-{j}"] not in (None, 0), f"trainer {j} did not fail: {codes}"
        text = (run_dir / "logs" / f"trainer-{j}.log").read_text()
        expected = f"trainer {j}: a collective with trainer {1 - j} failed"
        assert expected in text and f"within {4 * request_timeout_s:g} s" in text, text[-3000:]
    assert time.monotonic() - started < 240
