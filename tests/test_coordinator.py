"""Roles that know only the coordinator's address (`launch.py --role ps|trainer
--coordinator HOST:PORT`), as real processes on loopback.

The data lives beside the spec, in the oracle's folder; every other role runs in a folder of
its own, where the spec's relative data path leads nowhere: a role that opened the data
would fail. The run must end bit-identical to the local launcher's run of the same spec,
the PS shards and the oracle must exit by themselves, a role of another job must be refused,
and a PS whose coordinator is gone must exit naming it. Over mutual TLS, roles given only
their own certificate files join and train the same model.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from common.data.samples import CRITEO_KAGGLE as DATA
from common.job import build_job
from common.spec import load_spec
from launcher.inprocess import run_in_process
from launcher.zygote import RoleProcess, RoleStart, start_role
from tests.cluster_helpers import TOKEN, differing_elements, final_model, run_spec, write_spec
from tests.test_launch import LAUNCH, wait_for
from tests.tls_fixtures import TlsFiles

pytestmark = pytest.mark.slow
ROWS = 2000
#: The data file beside the spec; each table hashed into 4,096 rows (Kaggle's cardinalities
#: would give each PS 17 M rows to allocate, restore and compare, for nothing these tests ask).
CRITEO = {"format": "criteo", "path": "clicks.tsv", "eval_fraction": 0.1, "table_sizes": [4096] * 26}
OVERRIDES = {
    "oracle": {"mode": "bagpipe", "lookahead": 6, "prefetch_lead": 2, "cache_rows": 2000},
    "model": {"name": "dlrm", "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]},
    "train": {"batch_size": 64, "epochs": 1, "max_iterations": 20},
    "cluster": {"reconnect_s": 3},
}


@pytest.fixture
def oracle_host(tmp_path: Path) -> Path:
    """The oracle's folder: the spec, and beside it the only copy of the data."""
    folder = tmp_path / "oracle-host"
    folder.mkdir()
    with DATA.open() as src, (folder / "clicks.tsv").open("w") as dst:
        dst.writelines(itertools.islice(src, ROWS))
    return folder


class Roles:
    """Role processes of one test, each in its own folder ("host"), killed at the end. Each
    is `python launch.py ARGS` as typed on its host, forked warm as the launcher forks its
    roles (launcher/zygote.py) where it can be."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.processes: list[RoleProcess] = []

    def start(self, name: str, *args: str, cwd: Path | None = None, token: str = TOKEN) -> RoleProcess:
        host = cwd or self.tmp_path / name
        host.mkdir(exist_ok=True)
        start = RoleStart(script=str(LAUNCH), argv=list(args), env={**os.environ, "BAGPIPE_TOKEN": token},
                          cwd=str(host), log=str(self.tmp_path / f"{name}.log"), name=name[:15], launcher=os.getpid())
        process = start_role(start)
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def oracle(self, spec: Path, *flags: str) -> str:
        ready = self.tmp_path / "oracle.ready"
        process = self.start("oracle", str(spec), "--role", "oracle", "--ready-file", str(ready), *flags,
                             cwd=spec.parent)
        wait_for(lambda: ready.exists() or process.poll() is not None, 120, "the oracle's ready file")
        assert process.poll() is None, self.log("oracle")
        return f"127.0.0.1:{orjson.loads(ready.read_bytes())['port']}"

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture
def roles(tmp_path: Path) -> Iterator[Roles]:
    started = Roles(tmp_path)
    yield started
    started.kill_all()


@pytest.mark.nightly  # CI keeps the cross-folder resume below, which also ends bit-identical
def test_roles_that_know_only_the_coordinator_train_the_same_model(
    oracle_host: Path, roles: Roles, tmp_path: Path
) -> None:
    data = CRITEO
    spec = write_spec(oracle_host, "joined", OVERRIDES, data=data)
    job, _ = run_spec(spec, tmp_path / "launched")
    want = final_model(job, tmp_path / "launched")
    shutil.rmtree(job.spec.checkpoint.dir)

    coordinator = roles.oracle(spec)
    ps = [roles.start(f"ps-{i}", "--role", "ps", "--coordinator", coordinator) for i in range(2)]
    run_dir = tmp_path / "joined-run"
    trainers = [roles.start(f"trainer-{j}", "--role", "trainer", "--coordinator", coordinator,
                            "--run-dir", str(run_dir)) for j in range(2)]
    for name, process in [*((f"trainer-{j}", p) for j, p in enumerate(trainers)),
                          *((f"ps-{i}", p) for i, p in enumerate(ps)), ("oracle", roles.processes[0])]:
        assert process.wait(timeout=180) == 0, roles.log(name)  # every role ends by itself
    assert "every trainer has finished: the oracle exits" in roles.log("oracle")
    assert not list((tmp_path / "ps-0").rglob("*.tsv*")), "a PS host holds data"
    assert differing_elements(final_model(job, run_dir), want) == {}


def test_a_role_of_another_job_is_refused(oracle_host: Path, roles: Roles, tmp_path: Path) -> None:
    spec = write_spec(oracle_host, "mine", OVERRIDES)
    coordinator = roles.oracle(spec)
    stranger = roles.start("stranger", "--role", "ps", "--coordinator", coordinator, token="another-runs-token")
    assert stranger.wait(timeout=60) != 0
    assert f"the coordinator at {coordinator} refused this role's token" in roles.log("stranger"), roles.log("stranger")

    other = write_spec(tmp_path, "theirs", {**OVERRIDES, "train": {"batch_size": 32}})
    misfit = roles.start("misfit", str(other), "--role", "ps", "--coordinator", coordinator)
    assert misfit.wait(timeout=60) != 0
    assert "belongs to another job" in roles.log("misfit"), roles.log("misfit")
    assert "Traceback" not in roles.log("misfit"), roles.log("misfit")


def test_a_ps_whose_coordinator_is_gone_exits_naming_it(oracle_host: Path, roles: Roles) -> None:
    spec = write_spec(oracle_host, "orphan", OVERRIDES)
    job = build_job(load_spec(spec))
    coordinator = roles.oracle(spec)
    ready = roles.tmp_path / "ps.ready"
    shard = roles.start("ps-0", "--role", "ps", "--coordinator", coordinator, "--ready-file", str(ready))
    wait_for(lambda: ready.exists() or shard.poll() is not None, 60, "the PS ready file")
    roles.processes[0].send_signal(signal.SIGKILL)
    assert shard.wait(timeout=job.spec.cluster.reconnect_s + 30) != 0
    log = roles.log("ps-0")
    assert f"the coordinator at {coordinator} has been unreachable for 3 s" in log, log


def test_a_run_across_folders_resumes_from_the_coordinators_checkpoint(
    oracle_host: Path, roles: Roles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No folder is shared: `[checkpoint] dir` is relative, so each role writes under its own
    working folder; each PS keeps its snapshots there, trainer 0 sends the dense state to the
    oracle, which keeps it with the manifests. A run is made to have died after checkpoint 11
    (the later manifests deleted: a run this short ends before a kill could land), then every
    role is started again, the oracle with --resume and the others as before, following it:
    the run ends bit-identical to an uninterrupted one."""
    data = CRITEO
    spec = write_spec(oracle_host, "apart", {**OVERRIDES, "checkpoint": {"every": 4, "keep": 0}}, data=data)
    spec.write_text(spec.read_text().replace(f'dir = "{oracle_host / "checkpoints"}"', 'dir = "ckpt"'))
    (tmp_path / "launcher-host").mkdir()
    monkeypatch.chdir(tmp_path / "launcher-host")  # where the launched run's "ckpt" is
    job, _ = run_spec(spec, tmp_path / "launched")
    want = final_model(job, tmp_path / "launched")
    run_dir = tmp_path / "apart-run"

    def run_roles(*oracle_flags: str) -> None:
        coordinator = roles.oracle(spec, *oracle_flags)
        for i in range(2):
            roles.start(f"ps-{i}", "--role", "ps", "--coordinator", coordinator, "--index", str(i))
        for j in range(2):
            roles.start(f"trainer-{j}", "--role", "trainer", "--coordinator", coordinator, "--index", str(j),
                        "--run-dir", str(run_dir))
        for process in roles.processes:
            assert process.wait(timeout=180) == 0, [roles.log(n) for n in ("oracle", "ps-0", "trainer-0")]
        roles.processes.clear()
        (tmp_path / "oracle.ready").unlink()

    run_roles()
    assert (tmp_path / "ps-1" / "ckpt" / "ps-1" / "ckpt-0000000011").is_dir(), "no snapshot in the PS's folder"
    assert (oracle_host / "ckpt" / "trainer" / "dense-0000000011.pt").is_file()
    assert not (oracle_host / "ckpt" / "ps-0").exists(), "a snapshot in the oracle's folder"
    for c in (15, 19):
        (oracle_host / "ckpt" / f"ckpt-{c:010d}.json").unlink()

    run_roles("--resume")
    assert "resuming after checkpoint 11" in roles.log("trainer-1")
    assert "restored checkpoint 11" in roles.log("ps-0")
    # The final snapshots are in each shard's folder: gather them where final_model looks.
    for i in range(2):
        shutil.copytree(tmp_path / f"ps-{i}" / "ckpt" / f"ps-{i}", job.spec.checkpoint.dir / f"ps-{i}",
                        dirs_exist_ok=True)
    assert differing_elements(final_model(job, run_dir), want) == {}


def test_roles_joined_over_mutual_tls_train_the_same_model_and_a_plaintext_one_is_told(
    oracle_host: Path, roles: Roles, tmp_path: Path, tls_files: TlsFiles
) -> None:
    """The oracle's spec has [cluster.tls] with mutual = true; the PS shards and trainers
    joining it are given only their own files (--tls-ca, --tls-cert, --tls-key) and follow
    the job's mutual TLS. A role without them is told the port speaks TLS only, at once."""
    files = tls_files.section
    tls = {"cert": files.cert, "key": files.key, "ca": files.ca, "mutual": True}
    spec = write_spec(oracle_host, "joined-tls", {**OVERRIDES, "cluster": {**OVERRIDES["cluster"], "tls": tls}},
                      data=CRITEO)
    job = build_job(load_spec(spec))
    coordinator = roles.oracle(spec)
    plain = roles.start("plain", "--role", "ps", "--coordinator", coordinator)
    assert plain.wait(timeout=60) == 2
    assert "this port speaks TLS only" in roles.log("plain") and "Traceback" not in roles.log("plain"), roles.log("plain")
    own = ["--tls-ca", str(files.ca), "--tls-cert", str(files.cert), "--tls-key", str(files.key)]
    ps = [roles.start(f"ps-{i}", "--role", "ps", "--coordinator", coordinator, *own) for i in range(2)]
    run_dir = tmp_path / "joined-run"
    trainers = [roles.start(f"trainer-{j}", "--role", "trainer", "--coordinator", coordinator, "--run-dir",
                            str(run_dir), *own) for j in range(2)]
    for name, process in [*((f"trainer-{j}", p) for j, p in enumerate(trainers)),
                          *((f"ps-{i}", p) for i, p in enumerate(ps)), ("oracle", roles.processes[0])]:
        assert process.wait(timeout=180) == 0, roles.log(name)
    assert "serving h2 over TLS" in roles.log("ps-0")
    assert differing_elements(final_model(job, run_dir), run_in_process(job).model) == {}
