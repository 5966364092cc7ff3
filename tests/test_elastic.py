"""An elastic job (`[trainers] min_count` .. `max_count`) as real processes joined through the
coordinator (docs/design.md#elastic-trainers): a trainer killed with SIGKILL makes every role
go back to the latest complete checkpoint and go on with the trainers that remain, and a
trainer that registers while the job runs joins it at the next checkpoint. No person is
involved; the run ends bit-identical to the data-parallel reference that slices by the
trainer count of each term, which a run resumed by hand with those counts at those
checkpoints also gives (tests/test_reshard.py)."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import orjson
import pytest

from common.job import build_job
from common.spec import load_spec
from tests.cluster_helpers import as_final, differing_elements, final_model, reference_for, write_spec
from tests.test_coordinator import Roles, roles  # noqa: F401  (the fixture)
from tests.test_launch import wait_for

pytestmark = pytest.mark.slow
EVERY = 6
ELASTIC = {
    "trainers": {"count": 2, "min_count": 1, "max_count": 2},
    "checkpoint": {"every": EVERY, "keep": 0},
    "oracle": {"cache_rows": 200},
    "cluster": {"rejoin_timeout_s": 5, "reconnect_s": 20, "request_timeout_s": 20},
    "data": {"format": "synthetic", "rows": 9000, "table_sizes": [50, 200, 1000, 5000], "num_dense": 4,
             "top1_share": 0.5, "eval_fraction": 0.1, "seed": 1},
    "train": {"batch_size": 32, "epochs": 1, "max_iterations": 240},
}
TERM = re.compile(r"term (\d+): (\d+) trainer\(s\) from iteration (\d+)")


def _iterations_recorded(path: Path) -> int:
    if not path.exists():
        return 0
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # the trainer may be writing its last line
    done = [orjson.loads(line)["iteration"] for line in complete.splitlines()
            if line.startswith(b'{"kind":"iter"')]
    return max(done, default=0)


def _terms(log: str) -> list[tuple[int, int, int]]:
    """(term, trainers, first iteration) of each regroup, from the oracle's log."""
    return [(int(t), int(n), int(x)) for t, n, x in TERM.findall(log)]


@pytest.mark.parametrize("mode", ["bagpipe", pytest.param("no-cache", marks=pytest.mark.nightly),
                                  pytest.param("static-cache", marks=pytest.mark.nightly)])
def test_an_elastic_job_shrinks_when_a_trainer_dies_and_grows_when_one_joins(
    roles: Roles, tmp_path: Path, mode: str  # noqa: F811
) -> None:
    spec_path = write_spec(tmp_path, "elastic", {**ELASTIC, "oracle": {**ELASTIC["oracle"], "mode": mode}})
    job = build_job(load_spec(spec_path))
    coordinator = roles.oracle(spec_path)
    for i in range(2):
        roles.start(f"ps-{i}", "--role", "ps", "--coordinator", coordinator, "--index", str(i))
    run_dir = tmp_path / "run"
    trainers = [roles.start(f"trainer-{j}", "--role", "trainer", "--coordinator", coordinator, "--index", str(j),
                            "--run-dir", str(run_dir)) for j in range(2)]
    wait_for(lambda: _iterations_recorded(run_dir / "trainer-1.jsonl") >= 2 * EVERY + 3, 120,
             "trainer 1 past its second checkpoint")
    trainers[1].send_signal(signal.SIGKILL)
    wait_for(lambda: len(_terms(roles.log("oracle"))) >= 1, 60, "the regroup without trainer 1")
    joiner = roles.start("trainer-new", "--role", "trainer", "--coordinator", coordinator, "--run-dir", str(run_dir))
    survivors = [("trainer-0", trainers[0]), ("trainer-new", joiner), ("ps-0", roles.processes[1]),
                 ("ps-1", roles.processes[2]), ("oracle", roles.processes[0])]
    for name, process in survivors:
        assert process.wait(timeout=240) == 0, (name, roles.log(name)[-3000:], roles.log("oracle")[-3000:])

    terms = _terms(roles.log("oracle"))
    # A trainer starved of the CPU for rejoin_timeout_s on a loaded machine is gone too,
    # and the job regroups again: later terms may follow, and the reference follows them all.
    assert [(t, n) for t, n, _ in terms[:2]] == [(1, 1), (2, 2)], terms
    starts = [x for _, _, x in terms]
    assert all(x % EVERY == 0 for x in starts) and starts == sorted(starts), terms
    assert "trainer(s) wait to join" in roles.log("oracle")

    def slices(x: int) -> int:
        return next((n for _, n, first in reversed(terms) if x >= first), 2)

    got = final_model(job, run_dir)
    assert differing_elements(got, as_final(reference_for(job, slices=slices))) == {}
    assert differing_elements(got, as_final(reference_for(job, slices=2)))  # the count did change the steps


def _trainer_pid(run_dir: Path, index: int) -> int | None:
    """The process of trainer `index` of the local run in `run_dir` (its command line says so)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv]
        if "--role" in words and "trainer" in words and str(run_dir) in words and "--index" in words:
            if words[words.index("--index") + 1] == str(index):
                return int(proc.name)
    return None


def test_a_local_elastic_run_goes_on_without_a_dead_trainer_and_reports_its_terms(tmp_path: Path) -> None:
    """`python launch.py SPEC` of an elastic spec: trainer 1 killed; the launcher logs it, the
    job shrinks by itself, and the report shows both terms."""
    from launcher.cluster import JOIN_SCRIPT, run_local_cluster
    from trainer.records import read_run, terms_of

    spec_path = write_spec(tmp_path, "local-elastic", ELASTIC)
    job = build_job(load_spec(spec_path))
    run_dir = tmp_path / "run"
    killed: list[int] = []

    def kill_trainer_1() -> None:
        wait_for(lambda: _iterations_recorded(run_dir / "trainer-1.jsonl") >= 2 * EVERY + 3, 120, "trainer 1")
        pid = _trainer_pid(run_dir, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_trainer_1, daemon=True)
    killer.start()
    assert run_local_cluster(spec_path, run_dir=run_dir, quiet=True) == 0
    killer.join(5)
    assert killed, "trainer 1 was never killed"
    assert (run_dir / JOIN_SCRIPT).stat().st_mode & 0o777 == 0o700
    terms = terms_of(read_run(run_dir, 2))
    # As above: on a loaded machine the one trainer left may be unheard of long enough to
    # regroup again, by itself; nobody joins here, so every later term has it alone.
    assert [(t.term, t.trainers) for t in terms[:2]] == [(0, 2), (1, 1)], terms
    assert all(t.trainers == 1 for t in terms[2:]), terms
    shrank = terms[1].first_iteration
    report = orjson.loads((run_dir / "report.json").read_bytes())
    assert report["extra"]["terms"][1] == {"term": 1, "trainers": 1, "first_iteration": shrank}
    assert report["summary"]["trainers"] == 1 and (run_dir / "trainers.png").stat().st_size > 0
    got = final_model(job, run_dir)
    assert differing_elements(got, as_final(reference_for(job, slices=lambda x: 2 if x < shrank else 1))) == {}
