#!/usr/bin/env python3
"""Start a Bagpipe-style training cluster, or one role of it.

    python launch.py                          the default local cluster (examples/local.toml)
    python launch.py SPEC.toml                a whole local cluster: oracle, PS shards and
                                              trainers as subprocesses, with a progress bar
                                              and a final report in runs/<name>/
    python launch.py SPEC.toml --resume       the same, from the latest complete checkpoint
    python launch.py SPEC.toml --until N      a stream (data.watch): train until iteration N
                                              (Ctrl-C: end at the next checkpoint; twice: now)
    python launch.py SPEC.toml --tls          the same over TLS, with a throw-away CA and
                                              certificate made in the run folder
                                              (--tls-mutual: servers require client certificates)
    python launch.py SPEC.toml --role ps --index 1
    python launch.py SPEC.toml --role oracle
    python launch.py SPEC.toml --role trainer --index 0
                                              one role, for clusters across machines: every
                                              machine reads the same spec, whose addresses
                                              say where each role listens
    python launch.py --role ps --coordinator HOST:PORT
    python launch.py --role trainer --coordinator HOST:PORT
                                              one role that knows only the oracle's address
                                              (and $BAGPIPE_TOKEN): it registers, learns the
                                              job from the oracle and needs no spec and no
                                              data; a trainer under torchrun takes its rank
                                              and rendezvous from torchrun
    python launch.py SPEC.toml --role ps --index 1 --rejoin
    python launch.py SPEC.toml --role oracle --first-iteration F
                                              restart a dead PS shard or oracle alone while
                                              the trainers wait (F: where they started)
    python launch.py SPEC.toml --role ps --index 1 --fresh
                                              a PS of a new run over an old run's snapshots
                                              (without a flag it refuses to delete them)
    python launch.py export SPEC.toml --out DIR [--checkpoint C|latest] [--torchrec]
                                              a finished run's model (or a checkpoint's) as
                                              safetensors for serving (export --help)
    python launch.py stop SPEC.toml           end a running stream (data.watch) at its next
                                              checkpoint (or --coordinator HOST:PORT)
    python launch.py predict DIR [--data FILE]
                                              AUC and log loss of an exported model on the
                                              run's held-out rows, or on FILE (predict --help)

The bearer token comes from the spec's cluster.token or $BAGPIPE_TOKEN; a local cluster
generates one when neither is set. TLS: the spec's [cluster.tls], or a role's own files with
--tls-ca, --tls-cert and --tls-key (a role joining through the coordinator needs them when
the job speaks TLS). See docs/configuration.md for every spec field.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn
from pathlib import Path

from common.errors import BagpipeError, ConfigError
from common.spec import ClusterSpec, Endpoint, TlsSection

DEFAULT_SPEC = Path(__file__).resolve().parent / "examples" / "local.toml"
ROLES = ("ps", "oracle", "trainer")
TOOLS = ("export", "predict", "stop")  # subcommands, each with its own arguments


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("spec", nargs="?", help=f"cluster spec (TOML; default {DEFAULT_SPEC.relative_to(DEFAULT_SPEC.parents[1])}, "
                                                "none with --coordinator)")
    parser.add_argument("--role", choices=ROLES, help="start only this role (default: a whole local cluster)")
    parser.add_argument("--index", type=int, help="PS shard or trainer rank (with --role; default 0, or "
                                                  "the lowest free one with --coordinator)")
    parser.add_argument("--resume", action="store_true", help="restart from the latest complete checkpoint")
    parser.add_argument("--run-dir", type=Path, help="where records, logs and reports go (default runs/<name>)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (a log line every 10%%)")
    parser.add_argument("--until", type=int, metavar="ITERATION",
                        help="a stream (data.watch): train until this iteration, then end with a checkpoint "
                             "(the oracle; a local cluster passes it on). Without it a stream trains until "
                             "train.max_iterations, or until SIGTERM to the oracle or POST /v1/stop")
    joined = parser.add_argument_group("joining through the coordinator (the oracle)")
    joined.add_argument("--coordinator", help="HOST:PORT of the oracle: PS and trainer roles learn the job from it")
    joined.add_argument("--bind", help="PS: HOST:PORT to serve on (default: this host's address towards "
                                       "the coordinator, any free port)")
    joined.add_argument("--transport", choices=("h2", "http1"), default="h2",
                        help="the coordinator's protocol (the spec's cluster.transport; default h2)")
    roles = parser.add_argument_group("addresses chosen at start-up (the local launcher passes these)")
    roles.add_argument("--oracle-address", help="HOST:PORT of the oracle, overriding the spec")
    roles.add_argument("--ps-addresses", help="HOST:PORT,... of the PS shards, overriding the spec")
    roles.add_argument("--rendezvous", help="HOST:PORT of the trainers' rendezvous, overriding the spec")
    roles.add_argument("--ready-file", type=Path, help="file a role writes once it listens")
    roles.add_argument("--cpus", type=_cpu_list, help="cores this role keeps to, e.g. 0,1")
    alone = parser.add_argument_group("restarting one role while the others run on")
    alone.add_argument("--rejoin", action="store_true",
                       help="PS: come back with this shard's latest snapshot; the trainers replay the rest")
    alone.add_argument("--first-iteration", type=int,
                       help="oracle: the iteration the running trainers started from (0, or c + 1 "
                            "after resuming from checkpoint c); it replans from there")
    alone.add_argument("--fresh", action="store_true",
                       help="PS: start a new run, deleting this shard's snapshots (without --resume or "
                            "--rejoin, a PS refuses to start empty over snapshots of a run that may go on)")
    alone.add_argument("--admin-port", type=int,
                       help="PS or oracle: port of its HTTP/1.1 listener (default: port + 1, any free one for port 0)")
    tls = parser.add_argument_group("TLS (instead of the spec's [cluster.tls])")
    tls.add_argument("--tls", action="store_true",
                     help="a local cluster over TLS, with a throw-away CA and certificate made in <run dir>/tls/")
    tls.add_argument("--tls-ca", type=Path, help="this role's CA certificate (PEM), with --tls-cert and --tls-key")
    tls.add_argument("--tls-cert", type=Path, help="this role's certificate (PEM), for its servers and as a client")
    tls.add_argument("--tls-key", type=Path, help="its private key (PEM, unencrypted, mode 0600)")
    tls.add_argument("--tls-mutual", action="store_true",
                     help="servers accept only clients with a certificate the CA signed (the spec's cluster.tls.mutual)")
    return parser.parse_args(argv)


def _cpu_list(text: str) -> tuple[int, ...]:
    from common.runtime import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        return _run_tool(argv[0], argv[1:])
    args = parse_args(argv)
    if args.coordinator and args.role not in ("ps", "trainer"):
        print("launch.py: --coordinator is for --role ps or --role trainer", file=sys.stderr)
        return 2
    if args.spec is None and not args.coordinator:
        args.spec = str(DEFAULT_SPEC)
    if args.tls and args.role is not None:
        print("launch.py: --tls makes a throw-away CA for a local cluster; a role alone takes --tls-ca, "
              "--tls-cert and --tls-key", file=sys.stderr)
        return 2
    if args.role is None:
        from launcher.cluster import TlsChoice, run_local_cluster

        return _reporting_errors(lambda: run_local_cluster(
            Path(args.spec), resume=args.resume, run_dir=args.run_dir, quiet=args.quiet, until=args.until,
            tls=TlsChoice(generate=args.tls, mutual=args.tls_mutual, files=tls_files(args, None))))
    faulthandler.enable()  # a role killed by a signal leaves every thread's Python stack in its log
    # and `kill -USR1 PID` writes them there while it runs: where a role that seems stuck waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.role != "trainer":
        return _reporting_errors(lambda: run_role(args))
    # A trainer leaves without interpreter finalisation. Its process group outlives
    # destroy_process_group (DDP holds it), and a gloo worker that frees a tensor while the
    # interpreter finalises takes the GIL, gets unwound by CPython and aborts the process
    # ("terminate called without an active exception", pytorch/pytorch#190489): a finished
    # trainer then reads as killed by SIGABRT.
    try:
        code = _reporting_errors(lambda: run_role(args))
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_tool(name: str, argv: list[str]) -> int:
    from common.runtime import configure_logging

    if name == "export":
        from serving.export import main as tool
    elif name == "stop":
        from launcher.stop import main as tool
    else:
        from serving.predict import main as tool
    configure_logging(name)
    return _reporting_errors(lambda: tool(argv))


def _reporting_errors(run: Callable[[], int]) -> int:
    try:
        return run()
    except BagpipeError as exc:
        print(f"launch.py: {exc}", file=sys.stderr)
        return 2


def with_addresses(spec: ClusterSpec, args: argparse.Namespace) -> ClusterSpec:
    """The spec with the addresses given on the command line."""
    oracle, ps, trainers = spec.oracle, spec.ps, spec.trainers
    if args.oracle_address:
        oracle = dataclasses.replace(oracle, address=Endpoint.parse(args.oracle_address, "--oracle-address"))
    if args.ps_addresses:
        parts = args.ps_addresses.split(",")
        ps = dataclasses.replace(ps, addresses=tuple(Endpoint.parse(p, "--ps-addresses") for p in parts))
    if args.rendezvous:
        trainers = dataclasses.replace(trainers, rendezvous=Endpoint.parse(args.rendezvous, "--rendezvous"))
    return dataclasses.replace(spec, oracle=oracle, ps=ps, trainers=trainers)


def tls_files(args: argparse.Namespace, spec: ClusterSpec | None) -> TlsSection | None:
    """The TLS files the command line gives (all three, or none), mutual if it or the spec
    says so; None without them."""
    given = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    if not any(given.values()):
        return None
    if not all(given.values()):
        missing = ", ".join(f"--tls-{name}" for name, path in given.items() if path is None)
        raise ConfigError(f"--tls-{next(n for n, p in given.items() if p is None)}",
                          f"--tls-ca, --tls-cert and --tls-key go together: {missing} missing")
    spec_tls = None if spec is None else spec.cluster.tls
    mutual = args.tls_mutual or (spec_tls is not None and spec_tls.mutual)
    return TlsSection(**{name: path.resolve() for name, path in given.items()}, mutual=mutual, origin="--tls")


def role_tls(args: argparse.Namespace, spec: ClusterSpec | None) -> TlsSection | None:
    """A role's TLS section: its command line's files, else the spec's [cluster.tls]
    (mutual with --tls-mutual); None for a role without TLS."""
    section = tls_files(args, spec) or (None if spec is None else spec.cluster.tls)
    if args.tls_mutual:
        if section is None:
            raise ConfigError("--tls-mutual", "needs TLS: [cluster.tls] in the spec, or --tls-ca, --tls-cert "
                                              "and --tls-key")
        section = dataclasses.replace(section, mutual=True)
    return section


def run_role(args: argparse.Namespace) -> int:
    from common.runtime import configure_logging, pin_process, raise_file_limit, tune_malloc

    configure_logging(f"{args.role}[{'?' if args.index is None else args.index}]")
    raise_file_limit()
    tune_malloc()
    if args.cpus:
        pin_process(args.cpus)
    if args.coordinator:
        return run_joined_role(args)
    from common.job import build_job
    from common.spec import load_spec
    from common.transport import load_tls, run

    spec = with_addresses(load_spec(args.spec), args)
    tls = load_tls(role_tls(args, spec))
    job = build_job(spec)
    token = spec.token()
    index = args.index or 0
    if args.role == "ps":
        from ps.main import run_ps

        run(run_ps(job, index, token=token, resume=args.resume, ready_file=args.ready_file,
                   rejoin=args.rejoin, fresh=args.fresh, admin_port=args.admin_port, tls=tls))
    elif args.role == "oracle":
        from oracle.main import run_oracle

        run(run_oracle(job, token=token, ready_file=args.ready_file, resume=args.resume,
                       first_iteration=args.first_iteration, admin_port=args.admin_port, tls=tls,
                       until=args.until))
    else:
        from trainer.collectives import Rendezvous
        from trainer.main import Peers, run_trainer

        peers = Peers(oracle=spec.oracle.address, ps=spec.ps.addresses,
                      rendezvous=Rendezvous(store=spec.trainers.rendezvous, hosted=True))
        run_dir = args.run_dir or Path("runs") / spec.name
        run_trainer(job, index, token=token, peers=peers, run_dir=run_dir, resume=args.resume, tls=tls)
    return 0


def run_joined_role(args: argparse.Namespace) -> int:
    """A PS shard or trainer that knows only the coordinator's address (and the token)."""
    from common.spec import TOKEN_ENV, load_spec
    from common.transport import load_tls, run
    from oracle.coordinator_client import CoordinatorClient

    spec = load_spec(args.spec) if args.spec else None  # only checked against the coordinator's
    tls = load_tls(role_tls(args, spec))
    token = spec.token() if spec is not None else os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"launch.py: set ${TOKEN_ENV} to the job's token", file=sys.stderr)
        return 2
    coordinator = Endpoint.parse(args.coordinator, "--coordinator")
    reconnect_s = spec.cluster.reconnect_s if spec is not None else 30.0
    client = CoordinatorClient(coordinator, token=token, transport=args.transport, spec=spec, reconnect_s=reconnect_s,
                               tls=tls)
    if args.role == "ps":
        from ps.main import join_and_run_ps

        bind = Endpoint.parse(args.bind, "--bind") if args.bind else None
        run(join_and_run_ps(client, token=token, index=args.index, bind=bind, ready_file=args.ready_file,
                            resume=args.resume, rejoin=args.rejoin, fresh=args.fresh, admin_port=args.admin_port))
    else:
        from trainer.main import join_and_run_trainer

        join_and_run_trainer(client, token=token, index=args.index, run_dir=args.run_dir, resume=args.resume)
    return 0


def _leave(code: int) -> NoReturn:
    """Exit as the interpreter does, without its finalisation: the thread pools' exits
    and the non-daemon threads joined, then the atexit handlers (logging's flush, the
    zygotes, multiprocessing's children), as `Py_FinalizeEx` runs them. What is left,
    tearing down every module, costs about a second of CPU in a process that imported
    torch or numba and changes nothing a role leaves behind: what it writes is written
    and flushed before this."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's first step at exit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _leave(main())  # an exception (SystemExit with a message too) exits the interpreter's way
