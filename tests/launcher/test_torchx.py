"""The TorchX component (`launcher/torchx_component.py`): its command lines mean what
launch.py takes, every scheduler's replicas find the oracle, and a job run with
``torchx run -s local_cwd`` ends by itself with the run's outputs.

The command lines are checked without torchx. Without an image, every role runs the
interpreter running torchx, whatever `python` is on PATH. torchx (and the Kubernetes client its
kubernetes scheduler needs even for a dry run) is optional tooling, in
requirements-torchx.txt: without it the tests that use it are skipped, saying so. A
replica's ``bash -c`` line is run for real, with a stand-in ``python`` on PATH that prints
its arguments, under the environment the scheduler would give it.
"""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from common.addresses import free_port
from launch import parse_args
from launcher.torchx_component import (
    BAGPIPE_COORDINATOR_MARK, bagpipe, default_python, joined_argv, joined_shell_line, oracle_argv,
)
from tests.cluster_helpers import write_spec
from tests.test_launch import ROOT
from trainer.records import EvalRecord, IterationRecord, read_records, trainer_log_path

NO_TORCHX = "torchx is optional tooling: pip install -r requirements-torchx.txt"
ROLES = ["oracle-0", "ps-0", "ps-1", "trainer-0", "trainer-1", "trainer-2"]
TOKEN = "torchx-test-token"


@pytest.fixture
def echo_python(tmp_path: Path) -> Path:
    """A folder holding a ``python`` that prints its arguments, one a line."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "python"
    script.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def run_line(entrypoint: str, args: list[str], echo_python: Path, env: dict[str, str]) -> list[str]:
    """What a replica would run, with the stand-in python: the arguments it gets."""
    out = subprocess.run([entrypoint, *args], env={"PATH": f"{echo_python}:{os.environ['PATH']}", **env},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


# --- without torchx ----------------------------------------------------------------------


def test_the_oracle_reads_the_spec_and_listens_on_every_interface() -> None:
    argv = oracle_argv("specs/job.toml", 29400)
    assert argv[0] == "launch.py"
    args = parse_args(argv[1:])
    assert (args.spec, args.role, args.coordinator) == ("specs/job.toml", "oracle", None)
    assert args.oracle_address == "0.0.0.0:29400"


@pytest.mark.parametrize("role", ["ps", "trainer"])
def test_a_joined_role_reads_the_oracle_host_when_it_starts(role: str, echo_python: Path) -> None:
    argv = joined_argv(role, BAGPIPE_COORDINATOR_MARK, "3", transport="http1", run_dir="/shared/runs/x")
    line = joined_shell_line("python", argv, host_env="ORACLE_HOST", port=29400)
    got = run_line("bash", ["-c", line], echo_python, {"ORACLE_HOST": "node017"})
    assert got[0] == "launch.py"
    args = parse_args(got[1:])
    assert (args.role, args.coordinator, args.index, args.spec) == (role, "node017:29400", 3, None)
    assert args.transport == "http1"
    assert args.run_dir == (Path("/shared/runs/x") if role == "trainer" else None)


def test_a_joined_role_without_the_oracle_host_stops_naming_the_variable(echo_python: Path) -> None:
    line = joined_shell_line("python", joined_argv("ps", BAGPIPE_COORDINATOR_MARK, "0", transport="h2", run_dir=None),
                             host_env="ORACLE_HOST", port=29400)
    out = subprocess.run(["bash", "-c", line], env={"PATH": f"{echo_python}:{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and out.stdout == ""
    assert "ORACLE_HOST: is unset (the oracle host)" in out.stderr


def test_without_an_image_the_roles_run_the_interpreter_running_torchx(tmp_path: Path) -> None:
    assert default_python(None) == sys.executable
    assert default_python(str(tmp_path)) == sys.executable  # local_dir: the image is a folder here
    assert default_python("registry/bagpipe:1") == "python"  # the image's own


# --- dry runs: what each scheduler would be asked ----------------------------------------


@pytest.fixture
def runner() -> Any:
    pytest.importorskip("torchx", reason=NO_TORCHX)
    from torchx.runner import get_runner

    with get_runner() as runner:
        yield runner


def app(**overrides: Any) -> Any:
    args: dict[str, Any] = {"spec": "examples/job.toml", "ps": 2, "trainers": 3, "image": "registry/bagpipe:1",
                            "port": 29400, "token": TOKEN, "env": {"BAGPIPE_LOG": "DEBUG"}}
    return bagpipe(**{**args, **overrides})


def test_the_app_has_the_oracle_first_then_the_shards_and_the_trainers(runner: Any) -> None:
    roles = app().roles
    assert [(r.name, r.num_replicas) for r in roles] == [("oracle", 1), ("ps", 2), ("trainer", 3)]
    assert all(r.env["BAGPIPE_TOKEN"] == TOKEN and r.env["BAGPIPE_LOG"] == "DEBUG" for r in roles)
    fresh = [app(token=None).roles[0].env["BAGPIPE_TOKEN"] for _ in range(2)]
    assert len(set(fresh)) == 2 and all(len(t) >= 32 for t in fresh), "no token: a fresh one per job"
    with pytest.raises(ValueError, match="at least one PS shard"):
        app(ps=0)


@pytest.mark.parametrize(("image", "python", "want"), [
    (None, None, sys.executable),
    ("registry/bagpipe:1", None, "python"),
    (None, "/opt/py/bin/python3", "/opt/py/bin/python3"),
])
def test_every_role_runs_the_interpreter_the_job_implies(
    runner: Any, echo_python: Path, image: str | None, python: str | None, want: str
) -> None:
    oracle, *joined = app(image=image, python=python).roles
    assert oracle.entrypoint == want and oracle.image == (image or "bagpipe:latest")
    for role in joined:  # `bash -c "exec PYTHON launch.py ..."`
        assert role.args[1].startswith(f"exec {shlex.quote(want)} launch.py ")


def test_kubernetes_dryrun_finds_the_oracle_through_volcano(runner: Any, echo_python: Path) -> None:
    pytest.importorskip("kubernetes", reason=NO_TORCHX)
    mounts = ["type=volume", "src=bagpipe-shared", "dst=/shared"]
    info = runner.dryrun(app(mounts=mounts), "kubernetes", cfg={"queue": "default", "namespace": "ml"})
    job = info.request.resource
    app_id = job["metadata"]["name"]
    assert job["spec"]["schedulerName"] == "volcano" and "svc" in job["spec"]["plugins"]
    tasks = {t["name"]: t["template"] for t in job["spec"]["tasks"]}
    assert list(tasks) == ROLES and all(t["replicas"] == 1 for t in job["spec"]["tasks"])
    containers = {name: pod.spec.containers[0] for name, pod in tasks.items()}
    assert {c.image for c in containers.values()} == {"registry/bagpipe:1"}
    assert all({e.name: e.value for e in c.env}["BAGPIPE_TOKEN"] == TOKEN for c in containers.values())
    for pod in tasks.values():  # the shared volume (data, checkpoints) in every pod
        claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim}
        paths = {m.name: m.mount_path for m in pod.spec.containers[0].volume_mounts}
        assert [paths[name] for name, claim in claims.items() if claim == "bagpipe-shared"] == ["/shared"]

    oracle = containers["oracle-0"]
    assert oracle.command == ["python", *oracle_argv("examples/job.toml", 29400)]
    assert {p.name: p.container_port for p in oracle.ports} == {"coordinator": 29400, "admin": 29401}
    # Volcano's svc plugin gives every pod VC_<TASK>_HOSTS (the task's name upper-cased, '-'
    # as '_') = <job>-<task>-<i>.<job>: the pods' hostname.subdomain under its headless service.
    host_env = "VC_ORACLE_0_HOSTS"
    oracle_host = f"{app_id}-oracle-0-0.{app_id}"
    for name in ROLES[1:]:
        role, index = name.split("-")
        command = containers[name].command
        assert command[:2] == ["bash", "-c"] and f"${{{host_env}:?" in command[2]
        args = parse_args(run_line(command[0], command[1:], echo_python, {host_env: oracle_host})[1:])
        assert (args.role, args.index, args.coordinator) == (role, int(index), f"{oracle_host}:29400")


def test_an_elastic_trainer_role_has_min_to_max_replicas_and_kubernetes_requires_only_the_min(runner: Any) -> None:
    pytest.importorskip("kubernetes", reason=NO_TORCHX)
    elastic = app(trainers=3, min_trainers=1)
    assert [(r.name, r.min_replicas, r.num_replicas) for r in elastic.roles] == [
        ("oracle", None, 1), ("ps", None, 2), ("trainer", 1, 3)]
    job = runner.dryrun(elastic, "kubernetes", cfg={"queue": "default"}).request.resource
    required = {t["name"]: t.get("minAvailable") for t in job["spec"]["tasks"]}
    assert {name: required[name] for name in ROLES[3:]} == {"trainer-0": 1, "trainer-1": 0, "trainer-2": 0}
    with pytest.raises(ValueError, match="min_trainers must be in 1..trainers = 3"):
        app(min_trainers=4)


def test_slurm_dryrun_finds_the_oracle_on_the_first_het_group(runner: Any, echo_python: Path) -> None:
    info = runner.dryrun(app(), "slurm", cfg={"partition": "cpu", "time": "1:00:00"})
    request = info.request
    assert list(request.replicas) == ROLES  # one het group each, the oracle's group 0
    script = request.materialize()
    assert script.count("#SBATCH hetjob") == len(ROLES) - 1
    assert script.count(f"--export=ALL,BAGPIPE_LOG=DEBUG,BAGPIPE_TOKEN={TOKEN}") == len(ROLES)
    oracle = request.replicas["oracle-0"]
    assert [oracle.entrypoint, *oracle.args] == ["python", *oracle_argv("examples/job.toml", 29400)]
    for name in ROLES[1:]:
        role, index = name.split("-")
        replica = request.replicas[name]
        assert f"--job-name={name}" in script and "${SLURM_JOB_NODELIST_HET_GROUP_0:?" in replica.args[1]
        got = run_line(replica.entrypoint, replica.args, echo_python, {"SLURM_JOB_NODELIST_HET_GROUP_0": "node017"})
        args = parse_args(got[1:])
        assert (args.role, args.index, args.coordinator) == (role, int(index), "node017:29400")


# --- a real job under torchx's local scheduler -------------------------------------------


@pytest.mark.slow
def test_local_cwd_runs_the_job_to_its_end(tmp_path: Path, echo_python: Path) -> None:
    """With no `--python` and a `python` on PATH that is not this one (a venv not activated):
    the stand-in would only print its arguments, so the job ends with its outputs only if
    every role ran the interpreter running torchx."""
    pytest.importorskip("torchx", reason=NO_TORCHX)
    spec = write_spec(tmp_path, "torchx", {"train": {"max_iterations": 20}, "cluster": {"reconnect_s": 5}})
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
        "launcher/torchx_component.py:bagpipe", "--spec", str(spec), "--ps", "2", "--trainers", "2",
        "--port", str(free_port("0.0.0.0")), "--run_dir", str(run_dir),
    ]
    env = {**os.environ, "PATH": f"{echo_python}:{os.environ['PATH']}"}
    # local_cwd runs every replica in torchx's working directory: the repository root.
    torchx = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = torchx.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        torchx.send_signal(signal.SIGTERM)  # torchx stops its replicas' process groups
        output, _ = torchx.communicate(timeout=30)
        pytest.fail(f"the job did not end within 300 s:\n{output[-6000:]}")
    assert torchx.returncode == 0 and "Job finished: SUCCEEDED" in output, output[-6000:]
    assert "every trainer has finished: the oracle exits" in output
    assert orjson.loads((run_dir / "final" / "final.json").read_bytes()) == {"iterations": 20, "ps_checkpoint": 20}
    assert (run_dir / "final" / "dense.pt").exists()
    for rank in range(2):
        records = read_records(trainer_log_path(run_dir, rank))
        iterations = [r.iteration for r in records if isinstance(r, IterationRecord)]
        assert iterations == list(range(20)), f"trainer {rank}"
    records = read_records(trainer_log_path(run_dir, 0))
    held_out = [r for r in records if isinstance(r, EvalRecord) and r.split == "held-out"]
    assert len(held_out) == 1 and held_out[0].iteration == 20 and held_out[0].count > 0
