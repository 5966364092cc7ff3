"""A TorchX component for a whole Bagpipe job: the oracle, S PS shards and T trainers.

    torchx run -s local_cwd launcher/torchx_component.py:bagpipe --spec SPEC.toml --ps 2 --trainers 2
    torchx run -s kubernetes -cfg queue=default --workspace "" \\
        launcher/torchx_component.py:bagpipe --spec SPEC.toml --ps 2 --trainers 2 --image REPO/bagpipe:TAG
    torchx run -s slurm -cfg partition=P launcher/torchx_component.py:bagpipe --spec SPEC.toml --ps 2 --trainers 2

The oracle is the app's first role, so the host of its one replica is what TorchX calls
"rank 0": every scheduler names an environment variable holding it (``macros.rank0_env``:
local ``TORCHX_RANK0_HOST`` = localhost; Kubernetes, through Volcano's svc plugin,
``VC_ORACLE_0_HOSTS`` = ``{app_id}-oracle-0-0.{app_id}``; Slurm ``SLURM_JOB_NODELIST_HET_GROUP_0``,
the node of the first het group). A PS shard or trainer reads it in a ``bash -c`` line and
joins through the coordinator there (``launch.py --role ps|trainer --coordinator``), with
its replica id as its index. The trainer role is elastic with ``--min_trainers``
(``min_replicas``: on Kubernetes the first that many trainer tasks are required, the others
optional), for a spec whose ``[trainers] min_count`` .. ``max_count`` it matches; a trainer
whose index the job's current term does not have waits to join it. Only the oracle opens the spec and the data, both as its working
directory sees them (the repository root: the image's WORKDIR, the Slurm job's directory).

Every role runs one interpreter: the image's ``python`` where the job names an image, else
the interpreter running torchx (`default_python`), so that ``.venv/bin/torchx run -s
local_cwd`` needs no activated venv.

TorchX loads this file by executing it (not importing it), and parses the arguments from the
function's annotations at run time: hence no ``from __future__ import annotations`` and the
``typing`` spellings its linter accepts. torchx is imported in `bagpipe` only, so that the
command lines can be checked without it.
"""

import os
import secrets
import shlex
import sys
from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:
    from torchx.specs import AppDef

BAGPIPE_LAUNCH = "launch.py"  # relative to the working directory of every replica
BAGPIPE_TOKEN_ENV = "BAGPIPE_TOKEN"
BAGPIPE_COORDINATOR_MARK = "@coordinator@"  # where `joined_shell_line` puts the coordinator
BAGPIPE_IMAGE = "bagpipe:latest"  # a role's image where the job names none (local_cwd ignores it)


def default_python(image: Optional[str]) -> str:
    """The interpreter of every role unless the job names one. In an image, the image's
    `python`. Without one (or with a folder of this machine, `local_dir`'s image) the roles
    run this checkout, on this machine or a file system it shares (Slurm): the interpreter
    running torchx has the requirements, and a venv's need not be on PATH (the local
    schedulers hand their replicas torchx's own PATH)."""
    if image is None or os.path.isdir(image):
        return sys.executable
    return "python"


def oracle_argv(spec: str, port: int) -> List[str]:
    """The oracle's arguments to launch.py: the spec, listening on every interface (the
    other roles reach it by its host's name)."""
    return [BAGPIPE_LAUNCH, spec, "--role", "oracle", "--oracle-address", f"0.0.0.0:{port}"]


def joined_argv(role: str, coordinator: str, index: str, *, transport: str, run_dir: Optional[str]) -> List[str]:
    """A PS shard's or trainer's arguments to launch.py: it knows only `coordinator`."""
    argv = [BAGPIPE_LAUNCH, "--role", role, "--coordinator", coordinator, "--index", index, "--transport", transport]
    if role == "trainer" and run_dir:
        argv += ["--run-dir", run_dir]
    return argv


def joined_shell_line(python: str, argv: List[str], *, host_env: str, port: int) -> str:
    """`python argv` as a bash line in which the coordinator (`BAGPIPE_COORDINATOR_MARK` in
    `argv`) is `$host_env:port`, read when the replica starts (an unset variable stops it,
    naming the variable). A lone ``$`` survives TorchX's macro substitution (`safe_substitute`),
    so the line is the same before and after it."""
    coordinator = f'"${{{host_env}:?is unset (the oracle host)}}:{port}"'
    words = [coordinator if word == BAGPIPE_COORDINATOR_MARK else shlex.quote(word) for word in [python, *argv]]
    return "exec " + " ".join(words)


def bagpipe(
    spec: str,
    ps: int,
    trainers: int,
    image: Optional[str] = None,
    port: int = 29400,
    token: Optional[str] = None,
    name: str = "bagpipe",
    run_dir: Optional[str] = None,
    transport: str = "h2",
    python: Optional[str] = None,
    cpu: int = 2,
    memMB: int = 4096,
    gpu: int = 0,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
    min_trainers: Optional[int] = None,
) -> "AppDef":
    """
    A Bagpipe job: one oracle (the coordinator, the only role that reads the spec and the
    data), ``ps`` PS shards and ``trainers`` trainers that join through the oracle. Every
    role exits 0 by itself when the run is done.

    Args:
        spec: the cluster spec, as the oracle's working directory sees it
        ps: PS shards: the spec's ps.shards
        trainers: trainers: the spec's trainers.count, or an elastic spec's trainers.max_count
        image: the container image (Kubernetes), its WORKDIR the repository root; none (local_cwd, Slurm): the roles run this checkout
        port: the oracle's coordinator port (its admin port is port + 1)
        token: the job's bearer token, every role's $BAGPIPE_TOKEN (default: a fresh one); the spec must leave cluster.token unset
        name: the app's name (the scheduler makes the app id from it)
        run_dir: the trainers' run directory (default runs/<spec name> in their working directory)
        transport: the coordinator's protocol, the spec's cluster.transport: h2 or http1
        python: the Python interpreter with the project's requirements (default: the image's python; without an image, the one running torchx)
        cpu: CPUs per replica
        memMB: memory per replica, in MB
        gpu: GPUs per trainer
        env: more environment variables for every role (e.g. GLOO_SOCKET_IFNAME=eth0,BAGPIPE_LOG=DEBUG)
        mounts: volumes for every role (Kubernetes), e.g. type=volume,src=CLAIM,dst=/shared (data, checkpoints)
        min_trainers: an elastic spec's trainers.min_count: the trainer role is elastic, min_trainers..trainers replicas
    """
    from torchx import specs

    if ps < 1 or trainers < 1:
        raise ValueError(f"a job needs at least one PS shard and one trainer, got ps={ps}, trainers={trainers}")
    if min_trainers is not None and not 1 <= min_trainers <= trainers:
        raise ValueError(f"min_trainers must be in 1..trainers = {trainers}, got {min_trainers}")
    role_env = {**(env or {}), BAGPIPE_TOKEN_ENV: token or secrets.token_urlsafe(24)}
    volumes = specs.parse_mounts(mounts) if mounts else []
    python = python or default_python(image)
    image = image or BAGPIPE_IMAGE

    def joined(role: str, replicas: int, gpus: int, least: Optional[int] = None) -> "specs.Role":
        argv = joined_argv(role, BAGPIPE_COORDINATOR_MARK, specs.macros.replica_id, transport=transport,
                           run_dir=run_dir)
        line = joined_shell_line(python, argv, host_env=specs.macros.rank0_env, port=port)
        return specs.Role(name=role, image=image, entrypoint="bash", args=["-c", line], env=dict(role_env),
                          num_replicas=replicas, min_replicas=least,
                          resource=specs.resource(cpu=cpu, gpu=gpus, memMB=memMB), mounts=list(volumes))

    oracle = specs.Role(
        name="oracle", image=image, entrypoint=python, args=oracle_argv(spec, port), env=dict(role_env),
        num_replicas=1, resource=specs.resource(cpu=cpu, memMB=memMB), mounts=list(volumes),
        port_map={"coordinator": port, "admin": port + 1},
    )
    # The oracle first: its host is the scheduler's rank 0 host, which every replica can read.
    return specs.AppDef(name=name, roles=[oracle, joined("ps", ps, 0), joined("trainer", trainers, gpu, min_trainers)])
