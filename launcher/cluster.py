"""A whole cluster on this machine: every role as a subprocess of the launcher.

Used by `python launch.py SPEC` and by the end-to-end benchmark and tests. Roles are started
in dependency order (PS shards and oracle, then trainers), each told the ports the others bound;
the launcher shows progress from the trainers' records and, when they finish, stops the
services and reports. If any role dies, or on Ctrl-C, every role is stopped within seconds
and the message names the role and shows its last log lines. Children get SIGTERM if the
launcher itself dies (PR_SET_PDEATHSIG), so nothing is orphaned. A role beside the launcher is
forked from a zygote that has imported its modules once (`launcher.zygote`): it starts in
milliseconds and is, to everyone else, the child a cold start would be.

With ``checkpoint.restart``, a dead role is brought back: a PS shard (when checkpoints are
taken) or the oracle alone, on its old port, while the trainers wait and reconnect
(``restart_alone``, the default); a trainer, or anything when several roles died, by
restarting every role from the latest complete checkpoint.

Over TLS (`TlsChoice`: the spec's ``[cluster.tls]``, files given to the launcher, or a
throw-away CA and certificate made in the run folder), every role is given the same files
on its command line, checked here before any role starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from common.addresses import free_port
from common.checkpoints import latest_complete, remove_all
from common.errors import BagpipeError, ConfigError
from common.job import Job, build_job
from common.runtime import pinned_cpus
from common.spec import TOKEN_ENV, ClusterSpec, Endpoint, TlsSection, load_spec
from common.transport import load_tls
from launcher.memory import RSS_FILE, RssRecorder
from launcher.zygote import ZYGOTES, RoleProcess, RoleStart, start_role
from oracle import NUMBA_CACHE_ENV
from oracle.compiled import is_compiled
from oracle.startup import check_capacity

if TYPE_CHECKING:
    from common.data.dataset import BackgroundConversion, Dataset

log = logging.getLogger(__name__)
LAUNCH = Path(__file__).resolve().parent.parent / "launch.py"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0
MAX_RESTARTS = 3
JOIN_SCRIPT = "join-trainer.sh"  # in an elastic run's folder: adds a trainer


class RoleFailed(BagpipeError):
    code = "role_failed"


@dataclass(frozen=True)
class Restart:
    role: str  # the role whose death caused it
    alone: bool  # only that role restarted (else every role, from the latest complete checkpoint)

    def __str__(self) -> str:
        return f"{self.role} alone" if self.alone else f"every role after {self.role}"


@dataclass
class Role:
    name: str
    process: RoleProcess
    log_path: Path
    ready_file: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def last_lines(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "    (no log)"
        return "\n".join(f"    {line}" for line in lines[-n:]) or "    (empty log)"


@dataclass(frozen=True)
class PsHost:
    """Where PS processes run when not beside the launcher: a command that enters that
    place (e.g. ``ip netns exec NS``) and the address they listen on there."""

    command_prefix: tuple[str, ...]
    address: str


@dataclass(frozen=True, kw_only=True)
class TlsChoice:
    """How `launch.py SPEC` speaks TLS: `generate` a throw-away CA and certificate, or use
    `files` given on its command line, or (neither) the spec's own ``[cluster.tls]``;
    `mutual` makes any of them mutual."""

    generate: bool = False
    mutual: bool = False
    files: TlsSection | None = None

    def section(self, spec: ClusterSpec, run_dir: Path) -> TlsSection | None:
        """The files every role is given (made now when generated), or None: no TLS."""
        from launcher.certs import make_certificates, spec_hosts

        own = spec.cluster.tls
        mutual = self.mutual or (own is not None and own.mutual) or (self.files is not None and self.files.mutual)
        if self.generate:
            return make_certificates(run_dir / "tls", spec_hosts(spec), mutual=mutual)
        section = self.files or own
        if section is None:
            if self.mutual:
                raise ConfigError("--tls-mutual", "needs TLS: --tls, [cluster.tls] in the spec, or --tls-ca, "
                                                  "--tls-cert and --tls-key")
            return None
        return dataclasses.replace(section, mutual=mutual)


def tls_arguments(section: TlsSection | None) -> list[str]:
    """The command-line arguments that give a role `section`'s files."""
    if section is None:
        return []
    argv = ["--tls-ca", str(section.ca), "--tls-cert", str(section.cert), "--tls-key", str(section.key)]
    return argv + (["--tls-mutual"] if section.mutual else [])


@dataclass(frozen=True)
class ClusterResult:
    run_dir: Path
    job: Job
    seconds: float
    restarts: tuple[Restart, ...] = ()


class LocalCluster:
    """Starts, watches and stops the roles of one local run."""

    def __init__(
        self, job: Job, run_dir: Path, *, token: str, resume: bool = False, ps_host: PsHost | None = None,
        tls: TlsSection | None = None, until: int | None = None,
    ) -> None:
        self.job = job
        self.until = until  # a stream's end (the oracle's --until)
        self.run_dir = run_dir
        self.token = token
        self.tls = tls
        self.resume = resume
        self.ps_host = ps_host
        self.roles: list[Role] = []
        self.ps_addresses: list[Endpoint] = []
        self.oracle_address: Endpoint | None = None
        self.first_iteration = 0  # where this start's trainers begin
        self._gone: set[str] = set()  # an elastic job's trainers that died
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        spec = self.job.spec
        if self.resume:
            latest = latest_complete(spec.checkpoint.dir, spec.ps.num_shards)
            self.first_iteration = 0 if latest is None else latest + 1
        # every kind of role imports in its zygote at once, while the first ones start
        kinds = ["ps"] if ps_shards(spec) and self.ps_host is None else []
        ZYGOTES.warm([*kinds, "oracle", "trainer"], self._env())
        if self.elastic:
            self._start_joined()
            return
        ps_args = []
        if self.ps_host is not None:
            ps_args = ["--ps-addresses", ",".join(f"{self.ps_host.address}:0" for _ in spec.ps.addresses)]
        ps = [
            self._spawn(f"ps-{i}", ["--role", "ps", "--index", str(i), *ps_args], ready=True, prefix=self._ps_prefix)
            for i in range(ps_shards(spec))
        ]
        # The oracle needs no PS: it starts with them, its planner compiling meanwhile.
        oracle = self._spawn("oracle", ["--role", "oracle", *self._until_args], ready=True)
        self.ps_addresses = [self._wait_ready(role) for role in ps]
        self.oracle_address = oracle_address = self._wait_ready(oracle)
        rendezvous = spec.trainers.rendezvous
        if rendezvous.port == 0:
            rendezvous = Endpoint(host=rendezvous.host, port=free_port(rendezvous.host))
        peers = [
            "--oracle-address", str(oracle_address),
            "--rendezvous", str(rendezvous),
            "--run-dir", str(self.run_dir),
        ]
        if self.ps_addresses:
            peers += ["--ps-addresses", ",".join(str(a) for a in self.ps_addresses)]
        for j in range(spec.trainers.count):
            self._spawn(f"trainer-{j}", ["--role", "trainer", "--index", str(j), *peers, *self._cpus(j)])

    @property
    def elastic(self) -> bool:
        """An elastic job: its PS shards and trainers join through the oracle, as on separate
        machines, so that they follow its regroups (`oracle.membership`)."""
        return self.job.spec.trainers.elastic and self.ps_host is None

    def _start_joined(self) -> None:
        spec = self.job.spec
        oracle = self._spawn("oracle", ["--role", "oracle", *self._until_args], ready=True)
        self.oracle_address = self._wait_ready(oracle)
        joined = ["--coordinator", str(self.oracle_address)]
        ps = [self._spawn(f"ps-{i}", ["--role", "ps", *joined, "--index", str(i)], ready=True)
              for i in range(ps_shards(spec))]
        self.ps_addresses = [self._wait_ready(role) for role in ps]
        for j in range(spec.trainers.count):
            self._spawn(f"trainer-{j}", ["--role", "trainer", *joined, "--index", str(j), "--run-dir",
                                         str(self.run_dir), *self._cpus(j)])
        self._write_join_script(joined)

    def _write_join_script(self, joined: list[str]) -> None:
        """``<run dir>/join-trainer.sh``: a trainer more for this elastic job (it joins at the
        next checkpoint, up to max_count). It holds the token: only its owner may read it."""
        argv = [sys.executable, str(LAUNCH), str(self.job.spec.source), "--role", "trainer", *joined,
                "--run-dir", str(self.run_dir), *tls_arguments(self.tls)]
        script = self.run_dir / JOIN_SCRIPT
        script.unlink(missing_ok=True)
        fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
        with os.fdopen(fd, "w") as out:
            out.write("#!/bin/sh\n# One more trainer for the elastic job "
                      f"{shlex.quote(self.job.spec.name)}: it joins at its next checkpoint.\n"
                      f"{TOKEN_ENV}={shlex.quote(self.token)} exec {shlex.join(argv)} \"$@\"\n")

    def _cpus(self, rank: int) -> list[str]:
        """`--cpus` for trainer `rank`: its share of this machine's cores, if it gets one."""
        cpus = pinned_cpus(self.job.spec.trainers, rank)
        return [] if cpus is None else ["--cpus", ",".join(map(str, cpus))]

    @property
    def _ps_prefix(self) -> tuple[str, ...]:
        return self.ps_host.command_prefix if self.ps_host is not None else ()

    @property
    def _until_args(self) -> list[str]:
        return [] if self.until is None else ["--until", str(self.until)]

    def can_restart_alone(self, name: str) -> bool:
        """Whether role `name` can come back on its own: the oracle always (it replans),
        a PS shard when checkpoints are taken (trainers replay what its snapshot lacks); in
        an elastic job neither (its roles follow the oracle's terms, which a new oracle lacks)."""
        if self.elastic:
            return False
        return name == "oracle" or (name.startswith("ps-") and self.job.spec.checkpoint.every > 0)

    def restart_alone(self, name: str) -> None:
        """Start role `name` again on its old address, while the others run on."""
        old = next(r for r in self.roles if r.name == name)
        if name == "oracle":
            assert self.oracle_address is not None
            args = ["--role", "oracle", "--oracle-address", str(self.oracle_address),
                    "--first-iteration", str(self.first_iteration), "--admin-port", "0", *self._until_args]
            prefix: tuple[str, ...] = ()
        else:
            index = name.removeprefix("ps-")
            args = ["--role", "ps", "--index", index, "--rejoin", "--admin-port", "0",
                    "--ps-addresses", ",".join(str(a) for a in self.ps_addresses)]
            prefix = self._ps_prefix
        position = self.roles.index(old)
        self.roles.remove(old)
        role = self._spawn(name, args, ready=True, prefix=prefix, resume=False)
        self.roles.insert(position, self.roles.pop())  # keep the stop order
        self._wait_ready(role)

    def trainers(self) -> list[Role]:
        return [r for r in self.roles if r.name.startswith("trainer-")]

    def check(self) -> bool:
        """True once every trainer exited cleanly; raises RoleFailed if any role died.

        The error names the role that died first as far as one poll can tell: when several
        are found dead at once, one killed by a signal comes before those that exited with
        an error, since a peer's death makes the others fail (gloo: "Connection reset by
        peer"), not get killed.
        """
        dead = [r for r in self.roles if _died(r)]
        if self.elastic:  # the job goes on without a dead trainer (the oracle fails if it cannot)
            for trainer in (r for r in dead if r.name.startswith("trainer-") and r.name not in self._gone):
                log.warning("%s %s: the elastic job goes on without it", trainer.name, _exit_text(trainer))
                self._gone.add(trainer.name)
            dead = [r for r in dead if not r.name.startswith("trainer-")]
        if dead:
            first, *others = sorted(dead, key=lambda r: (r.process.returncode or 0) >= 0)
            message = f"{first.name} {_exit_text(first)}"
            if others:
                message += " (then " + ", ".join(f"{r.name} {_exit_text(r)}" for r in others) + ")"
            message += f"; its last log lines ({first.log_path}):\n{first.last_lines()}"
            raise RoleFailed(message, role=first.name, dead=[r.name for r in dead])
        if self.elastic:
            oracle = next(r for r in self.roles if r.name == "oracle")
            return oracle.process.poll() == 0 and all(r.process.poll() is not None for r in self.trainers())
        return all(r.process.poll() == 0 for r in self.trainers())

    def stop(self) -> None:
        """SIGTERM every live role (trainers first), then SIGKILL what is left after a grace."""
        live = [r for r in reversed(self.roles) if r.process.poll() is None]
        for role in live:
            # SIGINT: a stream's oracle takes SIGTERM as "end at the next checkpoint"
            role.process.send_signal(signal.SIGINT if role.name == "oracle" else signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for role in live:
            try:
                role.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing it", role.name, STOP_TIMEOUT_S)
                role.process.kill()
                role.process.wait()

    def _spawn(
        self, name: str, args: list[str], *, ready: bool = False, prefix: tuple[str, ...] = (), resume: bool | None = None
    ) -> Role:
        log_path = self.run_dir / "logs" / f"{name}.log"
        ready_file = self.run_dir / f".{name}.ready" if ready else None
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        launch_args = [str(self.job.spec.source), *args, *tls_arguments(self.tls)]
        if ready_file is not None:
            launch_args += ["--ready-file", str(ready_file)]
        if self.resume if resume is None else resume:
            launch_args.append("--resume")
        start = RoleStart(script=str(LAUNCH), argv=launch_args, env=self._env(), cwd=os.getcwd(), log=str(log_path),
                          name=name, launcher=os.getpid())
        process = start_role(start, prefix=prefix)
        role = Role(name, process, log_path, ready_file)
        self.roles.append(role)
        return role

    def _env(self) -> dict[str, str]:
        return {**os.environ, TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1"}

    def _wait_ready(self, role: Role) -> Endpoint:
        assert role.ready_file is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while not role.ready_file.exists():
            self.check()
            if time.monotonic() > deadline:
                raise RoleFailed(f"{role.name} did not start within {START_TIMEOUT_S:.0f} s:\n{role.last_lines()}",
                                 role=role.name)
            time.sleep(0.05)
        role.info = orjson.loads(role.ready_file.read_bytes())
        return Endpoint(host=role.info["host"], port=role.info["port"])


def ps_shards(spec: ClusterSpec) -> int:
    """The PS shards a local run starts: none in local mode, whose trainers hold the whole
    table and write the final one themselves (final/table.npy)."""
    return 0 if spec.oracle.mode == "local" else spec.ps.num_shards


def run_cluster(
    job: Job,
    run_dir: Path,
    *,
    token: str,
    resume: bool = False,
    on_poll: Callable[[LocalCluster], None] | None = None,
    ps_host: PsHost | None = None,
    tls: TlsSection | None = None,
    until: int | None = None,
) -> ClusterResult:
    """Run a local cluster to the end; `on_poll(cluster)` is called every 0.2 s while it runs.
    Every role's RSS is recorded in ``run_dir/rss.jsonl`` about once a second (`launcher.memory`).
    With `tls` every role is given its files (instead of the spec's ``[cluster.tls]``).

    With ``checkpoint.restart = true`` in the spec, a role that dies is restarted (at most
    MAX_RESTARTS times): alone where `LocalCluster.can_restart_alone` allows, else with
    every other role from the latest complete checkpoint.
    """
    # A spec the data cannot run fails here: before any role starts, and before a fresh
    # run removes the outputs of the previous one.
    check_capacity(job)
    load_tls(tls or job.spec.cluster.tls)  # a missing or bad file fails here, naming it
    if not resume:
        for stale in [*run_dir.glob("trainer-*.jsonl"), run_dir / RSS_FILE]:
            stale.unlink(missing_ok=True)
        shutil.rmtree(run_dir / "final", ignore_errors=True)
        # A fresh run starts a fresh checkpoint history: an automatic restart must resume
        # from this run's checkpoints, never from an earlier run's.
        if job.spec.checkpoint.dir.is_dir() and any(job.spec.checkpoint.dir.iterdir()):
            log.info("fresh run: removing the old checkpoints in %s (--resume continues from them)",
                     job.spec.checkpoint.dir)
            remove_all(job.spec.checkpoint.dir)
    started = time.monotonic()
    restarts: list[Restart] = []
    rss = RssRecorder(run_dir / RSS_FILE)
    while True:
        cluster = LocalCluster(job, run_dir, token=token, resume=resume, ps_host=ps_host, tls=tls, until=until)
        try:
            cluster.start()
            _watch(cluster, on_poll, restarts, rss)
            break
        except RoleFailed as exc:
            if not job.spec.checkpoint.restart or len(restarts) >= MAX_RESTARTS:
                raise
            restarts.append(Restart(str(exc.fields.get("role", "?")), alone=False))
            log.warning("%s; restarting every role from the latest complete checkpoint (restart %d of %d)",
                        exc.message.splitlines()[0].split(";")[0], len(restarts), MAX_RESTARTS)
            resume = True
        finally:
            cluster.stop()
    return ClusterResult(run_dir=run_dir, job=job, seconds=time.monotonic() - started, restarts=tuple(restarts))


def _watch(
    cluster: LocalCluster, on_poll: Callable[[LocalCluster], None] | None, restarts: list[Restart], rss: RssRecorder
) -> None:
    """Poll until every trainer is done, restarting a lone dead PS or oracle on the way."""
    checkpoint = cluster.job.spec.checkpoint
    while True:
        rss.sample((r.name, r.process.pid) for r in cluster.roles if r.process.poll() is None)
        try:
            if cluster.check():
                break
        except RoleFailed as exc:
            role, dead = str(exc.fields.get("role")), exc.fields.get("dead", [])
            alone = checkpoint.restart and checkpoint.restart_alone and dead == [role]
            if not (alone and cluster.can_restart_alone(role)) or len(restarts) >= MAX_RESTARTS:
                raise
            restarts.append(Restart(role, alone=True))
            log.warning("%s; restarting it alone while the others wait (restart %d of %d)",
                        exc.message.splitlines()[0].split(";")[0], len(restarts), MAX_RESTARTS)
            cluster.restart_alone(role)
        if on_poll is not None:
            on_poll(cluster)
        time.sleep(0.2)
    if on_poll is not None:
        on_poll(cluster)


def _stream_summary(job: Job) -> dict[str, Any] | None:
    """What the oracle of a stream's run wrote as it ended (None if it did not end cleanly)."""
    from oracle.stream import STREAM_SUMMARY, stream_folder

    path = stream_folder(job.spec.checkpoint.dir) / STREAM_SUMMARY
    return orjson.loads(path.read_bytes()) if path.is_file() else None


def _run_length(records: dict[int, list[Any]]) -> int:
    """The iterations trained, from the records (a stream's end is known only once it ends)."""
    from trainer.records import IterationRecord

    return 1 + max((r.iteration for rs in records.values() for r in rs if isinstance(r, IterationRecord)), default=-1)


class GracefulStop:
    """Ctrl-C on a local stream's run: the first asks the oracle to end the stream at its
    next checkpoint (SIGTERM), the second stops every role at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self._asked = False
        self._passed_on = False
        self._previous: Any = None

    def __enter__(self) -> GracefulStop:
        self._previous = signal.signal(signal.SIGINT, self._interrupted)
        return self

    def __exit__(self, *_: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _interrupted(self, signum: int, frame: object) -> None:
        if self._asked:
            raise KeyboardInterrupt
        self._asked = True
        print("\nbagpipe: ending the stream at its next checkpoint (Ctrl-C again to stop at once)", file=sys.stderr)

    def pass_on(self, cluster: LocalCluster) -> None:
        if self._asked and not self._passed_on:
            self._passed_on = True
            oracle = next((r for r in cluster.roles if r.name == "oracle"), None)
            if oracle is not None and oracle.process.poll() is None:
                oracle.process.send_signal(signal.SIGTERM)


def run_local_cluster(
    spec_path: Path, *, resume: bool = False, run_dir: Path | None = None, quiet: bool = False,
    tls: TlsChoice = TlsChoice(), until: int | None = None,
) -> int:
    """`python launch.py SPEC`: run, show progress, print and save the report."""
    from common.data.dataset import open_dataset
    from common.data.spec import parse_data_spec
    from common.runtime import configure_logging

    configure_logging("launch")
    spec = load_spec(spec_path)
    # A source to convert is converted here, before the roles start, as far as training
    # needs to start (its first file); the rest converts while it runs, the roles reading along.
    data = parse_data_spec(spec.sections["data"], base_dir=spec.source.parent)
    # (a stream, data.watch, is read by the oracle alone, as its parts arrive)
    dataset = None if data.watch else open_dataset(data, progress=not quiet, background=True)
    conversion = getattr(dataset, "conversion", None)
    try:
        return _run_local(spec, dataset, conversion, resume=resume, run_dir=run_dir, quiet=quiet, tls=tls,
                          until=until)
    finally:
        if conversion is not None and not conversion.done:
            conversion.stop()  # what it converted is kept: the next run resumes it


def _run_local(spec: ClusterSpec, dataset: Dataset | None, conversion: BackgroundConversion | None, *, resume: bool,
               run_dir: Path | None, quiet: bool, tls: TlsChoice, until: int | None) -> int:  # fmt: skip
    from launcher.memory import format_rss, read_rss, rss_curves, summarise_rss
    from launcher.plots import plot_rss, plot_run, plot_terms
    from launcher.progress import ProgressBar
    from launcher.summary import iteration_series, summarise, write_report
    from launcher.text import format_stream, format_summary, format_terms
    from trainer.records import RunTail, read_run, terms_of, within_last_term

    job = build_job(spec, dataset=dataset)
    if job.model.factory is not None:  # a bad model of one's own fails here, not in every trainer
        from trainer.models import build_model

        build_model(job.model, job.num_dense, job.layout.num_tables)
    run_dir = (run_dir or Path("runs") / spec.name).resolve()
    token = spec.cluster.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    section = tls.section(spec, run_dir)
    stream = job.data.watch
    ends = [n for n in (until, spec.train.max_iterations) if n]
    total = (min(ends) if ends else None) if stream else job.iterations
    tail = RunTail(run_dir, spec.trainers.max_count)  # an elastic run's trainers come and go
    over = "" if section is None else f", over {'mutual ' if section.mutual else ''}TLS"
    print(f"bagpipe: {spec.name}: {spec.oracle.mode}, {ps_shards(spec) or 'no'} PS, {spec.trainers.count} trainers, "
          f"{total or 'a stream of'} iterations{over}; logs in {run_dir / 'logs'}", file=sys.stderr)
    if stream:
        print(f"bagpipe: training from the stream {job.data.path} as it arrives; Ctrl-C ends it at the next "
              "checkpoint (twice: at once)", file=sys.stderr)
    if tls.generate and section is not None:
        print(f"bagpipe: a throw-away CA and certificate in {section.ca.parent} (curl --cacert {section.ca} "
              f"--cert {section.cert} --key {section.key} https://…)", file=sys.stderr)
    if not is_compiled(spec.oracle.mode):  # the oracle compiles it before the trainers start
        print(f"bagpipe: compiling the planner (first run only; cached in {os.environ[NUMBA_CACHE_ENV]})",
              file=sys.stderr)

    told: list[bool] = []
    stop = GracefulStop() if stream else None

    def poll(cluster: LocalCluster) -> None:
        if stop is not None:
            stop.pass_on(cluster)
        if cluster.elastic and not told:
            told.append(True)
            print(f"bagpipe: an elastic job ({spec.trainers.min_count} to {spec.trainers.max_count} trainers): "
                  f"{run_dir / JOIN_SCRIPT} adds a trainer", file=sys.stderr)
        if conversion is not None and conversion.done and conversion.error is not None:
            raise conversion.error  # bad data further on: stop now, not when training gets there
        bar.update(tail.poll())

    try:  # the bar closes (and logs its last line) before an error is shown
        with ProgressBar(total, spec.name, trainers=spec.trainers.count, enabled=False if quiet else None) as bar, \
                stop or contextlib.nullcontext():
            result = run_cluster(job, run_dir, token=token, resume=resume, on_poll=poll, tls=section, until=until)
    except KeyboardInterrupt:
        print("\nbagpipe: interrupted; all roles stopped", file=sys.stderr)
        return 130
    except RoleFailed as exc:
        print(f"\nbagpipe: {exc}", file=sys.stderr)
        return 1
    every_record = read_run(run_dir, spec.trainers.max_count)
    terms = terms_of(every_record)
    records = within_last_term(every_record)  # the summary's lines up one set of trainers
    trainers = terms[-1].trainers if terms else spec.trainers.count
    first = terms[-1].first_iteration if terms else 0
    summary = summarise(records, mode=spec.oracle.mode, global_batch=spec.train.batch_size,
                        warmup=min(5, max(0, (_run_length(records) if total is None else total) - first) // 10),
                        trainers=trainers)
    print(format_summary(summary))
    if len(terms) > 1:
        print(format_terms(terms))
    series = iteration_series(records, trainers=trainers)
    curves = rss_curves(read_rss(run_dir), series.iterations, series.end_time)
    warm_from = int(series.iterations[0]) + memory_warmup(len(series.iterations))
    memory = summarise_rss(curves, warm_from)
    print(format_rss(memory, warm_from))
    extra: dict[str, Any] = {"spec": str(spec.source), "seconds": result.seconds,
                             "rss": [f.to_json() for f in memory.values()]}
    if terms:
        extra["terms"] = [{"term": t.term, "trainers": t.trainers, "first_iteration": t.first_iteration} for t in terms]
    if stream and (streamed := _stream_summary(job)) is not None:
        print(format_stream(streamed))
        extra["stream"] = streamed
    report = write_report(run_dir, summary, extra)
    plots = plot_run(run_dir, records, warmup=summary.warmup)
    plots.append(plot_rss(curves, warm_from, run_dir / "memory.png"))
    if terms:
        plots.append(plot_terms(terms, total or _run_length(records), run_dir / "trainers.png"))
    print(f"report: {report}\nplots: {', '.join(str(p) for p in plots)}")
    return 0


def memory_warmup(iterations: int) -> int:
    """Iterations left out of a run's memory figures: longer than the timing warm-up, since
    caches, buffers and the allocator's pools fill over the first hundreds of iterations."""
    return iterations // 5


def _died(role: Role) -> bool:
    """Exited with an error or a signal: a role that exits 0 finished its part (the PS
    shards and the oracle stop by themselves once the run is done)."""
    code = role.process.poll()
    return code is not None and code != 0


def _exit_text(role: Role) -> str:
    code = role.process.returncode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
