#!/usr/bin/env python3
"""The modes and TorchRec across five hosts on one machine, each host's link shaped. Root.

`bench/topology.py` builds the hosts oracle, ps0, ps1, tr0 and tr1 (network namespaces on one
switch), every host's link shaped by tbf to the rate, in both directions. Each role is started
on its host with the command a cluster across machines uses (the oracle with the spec, the
others with `--coordinator`: `start_roles`, the one place that says how); TorchRec's two ranks run on
tr0 and tr1 (`start_torchrec`). The job is `bench/e2e.py`'s (T = 2, S = 2, DLRM, synthetic
Criteo-like data, a cache far below the tables) and so is its window: the first fifth of a
run and its last `max_ahead` iterations, when the oracle has nothing left to plan, are not
measured. Unlike there, the oracle generates the rows as it reads them (2 to 4 ms of CPU an
iteration of 2,048, on cores every host shares), so that no file of data is visible to the
trainers' hosts (below); TorchRec's ranks generate theirs before their clock starts. Per rate
it prints samples/s, ms per phase (both from each run's report.json) and MB each host's link
carried per measured iteration.

Unlike `bench/e2e.py` on loopback, every byte between roles crosses two shaped links (sender
and receiver), trainer to trainer too: the trainers' and TorchRec's collectives are shaped.
All hosts still share this machine's cores.

Bagpipe prefetches up to `prefetch_lead` (8) iterations ahead, so the rows of the first
measured iterations crossed the links before the window opened, and those of the last
iterations after it closed: the two ends nearly cancel over a window of a hundred
iterations or more.

Only the oracle's host sees the bagpipe runs' specs (and any data they name): the PS shards
and trainers are started with the oracle's address alone and never open the data.
`--hide-data DIR` hides a further folder (e.g. file data) from every host but the oracle's.

    python bench/cluster.py --quick
    python bench/cluster.py --rates 1gbit,100mbit --modes bagpipe,no-cache,local
    python bench/cluster.py --quick --modes bagpipe --fault link-down:ps1:60:10 --fault slow-link:ps0:100mbit

`--fault` injects a fault into every run (`bench/faults.py`): a host's link down for a while
after an iteration, hosts cut from each other (`partition:tr0,tr1:AFTER`: the trainers fail,
naming each other), or one host's link slower than the others from the start.

`--smoke` runs `bench/e2e.py --smoke`'s small job, bagpipe alone at 1gbit unless `--modes`
and `--rates` say otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import STDOUT, Popen
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import (  # noqa: E402
    SMOKE_RESULTS, Table, add_result_options, config_of, e2e, results_path, torchrec_baseline, write_results,
)
from bench.faults import Fault, FaultInjector, parse_fault, shaped  # noqa: E402
from bench.topology import (  # noqa: E402
    HostSpec, Snapshot, Terminated, Topology, Traffic, parse_rate, stop_processes,
)
from common.errors import BagpipeError, ConfigError  # noqa: E402
from common.spec import MODES, TOKEN_ENV, load_spec, spec_toml  # noqa: E402
from launcher.summary import RunSummary, summarise, write_report  # noqa: E402
from launcher.text import compare_bytes, compare_modes  # noqa: E402
from trainer.records import IterationRecord, RunTail, read_run  # noqa: E402

NAME = "cluster"
ROOT = Path(__file__).resolve().parent.parent
HOSTS = ("oracle", "ps0", "ps1", "tr0", "tr1")
JOB_FOLDER = "job"  # the specs of the bagpipe runs: hidden on every host but the oracle's
TOKEN = "cluster-bench"
START_TIMEOUT_S = 300.0
MODES_RUN = ("bagpipe", "no-cache", "local")  # by default; --modes adds static-cache
SIZES = {
    "full": e2e.Size(iterations=400, batch=4096, cache_rows=65536),
    "quick": e2e.Size(iterations=200, batch=2048, cache_rows=32768),
    "smoke": e2e.SIZES["smoke"],
}


class RunFailed(BagpipeError):
    code = "run_failed"


@dataclass(frozen=True, kw_only=True)
class Role:
    """A role's process on its host; `ready_file` for the services, which write it once they listen."""

    name: str
    process: Popen[bytes]
    log_path: Path
    ready_file: Path | None = None

    def failure(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()[-15:] if self.log_path.exists() else []
        body = "\n".join(f"    {line}" for line in lines) or "    (empty log)"
        return f"{self.name} exited with code {self.process.returncode}; the end of {self.log_path}:\n{body}"

    def dump_stacks(self, timeout_s: float = 5.0) -> bool:
        """Have a role that is still running write every thread's Python stack into its log
        (launch.py's SIGUSR1), and wait until it is there; whether it came."""
        size = self.log_path.stat().st_size if self.log_path.exists() else 0
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            with open(self.log_path, "rb") as log:
                log.seek(size)
                if b"most recent call first" in log.read():
                    return True
            time.sleep(0.05)
        return False


def start_roles(net: Topology, spec: Path, run_dir: Path, *, port: int) -> list[Role]:
    """Start every bagpipe role on its host, as a cluster across machines starts them, and
    wait until the services listen: the oracle with the spec on its host, at `port`; each PS
    shard and trainer with the oracle's address alone (`--coordinator`), learning the job
    from it. The spec's folder is hidden on their hosts; the shards serve at `port` of
    theirs (`--bind`), and the trainers' collectives find their interface themselves."""
    coordinator = f"{net['oracle'].address}:{port}"
    launch = [sys.executable, str(ROOT / "launch.py")]
    oracle = _start(net, "oracle", "oracle", [*launch, str(spec), "--role", "oracle", "--oracle-address", coordinator,
                                               "--run-dir", str(run_dir)], run_dir, ready=True)
    _wait_ready([oracle])
    roles = [oracle]
    shards = [] if load_spec(spec).oracle.mode == "local" else [h for h in HOSTS if h.startswith("ps")]
    for i, host in enumerate(shards):
        argv = [*launch, "--role", "ps", "--coordinator", coordinator, "--index", str(i),
                "--bind", f"{net[host].address}:{port}"]
        roles.append(_start(net, host, f"ps-{i}", argv, run_dir, ready=True))
    for j, host in enumerate(h for h in HOSTS if h.startswith("tr")):
        argv = [*launch, "--role", "trainer", "--coordinator", coordinator, "--index", str(j), "--run-dir", str(run_dir)]
        roles.append(_start(net, host, f"trainer-{j}", argv, run_dir))
    _wait_ready(roles)
    return roles


def start_torchrec(net: Topology, spec: Path, run_dir: Path, *, port: int) -> list[Role]:
    """TorchRec's ranks on the trainer hosts, meeting at `port` on the first."""
    trainers = [h for h in HOSTS if h.startswith("tr")]
    meet = f"tcp://{net[trainers[0]].address}:{port}"
    return [_start(net, host, f"trainer-{r}", [sys.executable, "-m", "bench.torchrec_baseline", str(spec),
                                               "--rank", str(r), "--run-dir", str(run_dir), "--init-method", meet],
                   run_dir, env={"GLOO_SOCKET_IFNAME": net[host].interface})
            for r, host in enumerate(trainers)]


def _start(net: Topology, host: str, name: str, argv: list[str], run_dir: Path, *,
           ready: bool = False, env: Mapping[str, str] | None = None) -> Role:
    log_path = run_dir / "logs" / f"{name}.log"
    ready_file = run_dir / f".{name}.ready" if ready else None
    if ready_file is not None:
        argv = [*argv, "--ready-file", str(ready_file)]
    full_env = {**os.environ, TOKEN_ENV: TOKEN, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as out:
        process = net[host].popen(argv, env=full_env, cwd=ROOT, stdout=out, stderr=STDOUT)
    return Role(name=name, process=process, log_path=log_path, ready_file=ready_file)


def _wait_ready(roles: Sequence[Role]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(r.ready_file is None or r.ready_file.exists() for r in roles):
        _check(roles)
        if time.monotonic() > deadline:
            raise RunFailed(f"services not listening within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _check(roles: Sequence[Role]) -> bool:
    """True once every trainer exited cleanly; RunFailed naming the first role that died (the
    PS shards and the oracle exit 0 by themselves at the end)."""
    for role in roles:
        code = role.process.poll()
        if code is not None and code != 0:
            raise RunFailed(role.failure(), role=role.name)
    return all(r.process.poll() == 0 for r in roles if r.name.startswith("trainer-"))


class LinkWindow:
    """Link counters of one run: read at its start, once every trainer's records show the
    warm-up done, once they show the last iteration done, and at its end."""

    def __init__(self, net: Topology, run_dir: Path, *, trainers: int, warmup: int, iterations: int) -> None:
        self.net = net
        self.tail = RunTail(run_dir, trainers)
        self.done = [0] * trainers  # iterations each trainer has finished
        self.marks = (warmup, iterations)
        self.snapshots: list[tuple[Snapshot, int]] = []
        self.started = net.snapshot()

    def poll(self) -> None:
        for j, records in self.tail.poll().items():
            finished = [r.iteration + 1 for r in records if isinstance(r, IterationRecord)]
            self.done[j] = max([self.done[j], *finished])
        done = min(self.done)
        while len(self.snapshots) < 2 and done >= self.marks[len(self.snapshots)]:
            self.snapshots.append((self.net.snapshot(), done))

    def figures(self) -> dict[str, dict[str, dict[str, float]]]:
        """MB each host sent and received: per measured iteration ("per_iteration", between
        the middle two readings) and over the whole run ("run", start-up included)."""
        (before, first), (after, last) = self.snapshots
        whole = self.net.snapshot() - self.started
        return {"per_iteration": _mb(after - before, last - first), "run": _mb(whole, 1)}


def _mb(traffic: Traffic, per: int) -> dict[str, dict[str, float]]:
    return {h: {"sent": b.sent / 1e6 / per, "received": b.received / 1e6 / per} for h, b in traffic.links.items()}


Starter = Callable[[Topology, Path, Path], list[Role]]


def run_one(net: Topology, name: str, base: dict, out: Path, start: Starter,
            faults: Sequence[Fault] = ()) -> tuple[RunSummary, dict]:
    """One run of `base` with the roles `start` starts, `faults` fired as it goes: its
    summary as read back from its report.json, and the MB each host's link carried
    (`LinkWindow.figures`)."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # records append, a PS refuses old snapshots
    (run_dir / "logs").mkdir(parents=True)
    # Bagpipe's spec where only the oracle's host sees it (`run_rate`); TorchRec's ranks read theirs.
    spec = run_dir / "spec.toml" if name == torchrec_baseline.MODE else out / JOB_FOLDER / f"{name}.toml"
    sections = base if name == torchrec_baseline.MODE else e2e.mode_sections(name, base, run_dir)
    spec.write_text(spec_toml(f"cluster-{name}", e2e.SEED, sections))
    iterations, max_ahead = base["train"]["max_iterations"], base["oracle"]["max_ahead"]
    warmup = e2e.warmup_of(iterations)
    window = LinkWindow(net, run_dir, trainers=2, warmup=warmup, iterations=iterations - max_ahead)
    print(f"running {name} ...", file=sys.stderr, flush=True)
    roles: list[Role] = []
    injector = FaultInjector(net, faults)
    try:
        roles = start(net, spec, run_dir)
        while not _check(roles):
            window.poll()
            injector.poll(min(window.done))
            time.sleep(0.1)
        window.poll()
    finally:
        injector.heal()
        stop_processes([r.process for r in reversed(roles)])
    e2e.drop_saved_tables(run_dir)
    summary = summarise(read_run(run_dir, 2), mode=name, global_batch=base["train"]["batch_size"],
                        warmup=warmup, cooldown=max_ahead, trainers=2)
    links = window.figures()
    report = write_report(run_dir, summary, {"spec": str(spec), "link_mb": links})
    return RunSummary.from_json(orjson.loads(report.read_bytes())["summary"]), links


def link_table(links: Mapping[str, Mapping[str, Mapping[str, Mapping[str, float]]]], span: str) -> str:
    """MB each host's link carried over `span` ("per_iteration" or "run"), sent / received
    by the host, by run."""
    head = f"{'mode':<14}" + "".join(f"{h:>16}" for h in HOSTS)
    lines = [head, "-" * len(head)]
    for name, figures in links.items():
        cells = (f"{figures[span][h]['sent']:.2f} / {figures[span][h]['received']:.2f}" for h in HOSTS)
        lines.append(f"{name:<14}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def run_rate(rate: str, names: Sequence[str], base: dict, out: Path, hide: Path | None,
             faults: Sequence[Fault] = ()) -> dict[str, Any]:
    """Every run in `names` on a fresh topology whose links are shaped to `rate` (but for
    the slow links of `faults`), each with `faults` injected."""
    hidden = (out / rate / JOB_FOLDER, *([hide] if hide else []))
    hidden[0].mkdir(parents=True, exist_ok=True)
    hosts = shaped([HostSpec(name=h, rate=rate, hide_data=hidden if h != "oracle" else ()) for h in HOSTS], faults)
    summaries: dict[str, RunSummary] = {}
    links: dict[str, dict] = {}
    with Topology(hosts) as net:
        for k, name in enumerate(names):
            port = 7000 + 10 * k  # a fresh port per run: the last run's sockets may linger
            start = start_torchrec if name == torchrec_baseline.MODE else start_roles
            starter = functools.partial(start, port=port)
            summaries[name], links[name] = run_one(net, name, base, out / rate, starter, faults)
    return {"summaries": summaries, "links": links}


def print_rate(rate: str, result: Mapping[str, Any], base: dict) -> None:
    """The tables of one rate's runs."""
    train, cache_rows = base["train"], base["oracle"]["cache_rows"]
    iterations = train["max_iterations"]
    print(f"\n== every host's link at {rate} (tbf, both directions): {iterations} iterations per run "
          f"(the first {e2e.warmup_of(iterations)} and the last {base['oracle']['max_ahead']} excluded), global batch "
          f"{train['batch_size']}, C = {cache_rows} rows per trainer")
    print(compare_modes(result["summaries"]))
    print("\nms per iteration and trainer (machinery: all but forward, backward and the dense optimizer)")
    print(e2e.phase_table(result["summaries"]))
    print("\npayload MB per measured iteration and trainer, by kind (TorchRec's all-to-alls not counted)")
    print(compare_bytes(result["summaries"]))
    print("\nMB per measured iteration on each host's link, sent / received by the host")
    print(link_table(result["links"], "per_iteration"))
    print("\nMB over the whole run (from before the roles start to after they stopped), sent / received")
    print(link_table(result["links"], "run"), flush=True)


def parse_args() -> tuple[argparse.Namespace, e2e.Size]:
    """The arguments, and the size of the job they ask for."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 iterations of batch 2048 (else 400 of 4096)")
    parser.add_argument("--iterations", type=int, help="iterations per run (default 200 quick, 400 full)")
    parser.add_argument("--rates", help="comma-separated tc rates of every host's link (default 1gbit,100mbit; "
                                         "1gbit with --smoke)")
    parser.add_argument("--modes", help=f"comma-separated modes (default {','.join(MODES_RUN)}; bagpipe with --smoke)")
    parser.add_argument("--torchrec", action=argparse.BooleanOptionalAction, default=None,
                        help="add the TorchRec baseline (default: when torchrec is importable)")
    parser.add_argument("--hide-data", type=Path, help="a folder to hide from every host but the oracle's")
    parser.add_argument("--fault", action="append", default=[], metavar="FAULT",
                        help="inject a fault into every run (repeatable): link-down:HOST:AFTER:SECONDS, "
                             "partition:HOST,HOST:AFTER (no way through between them), slow-link:HOST:RATE; "
                             f"hosts {','.join(HOSTS)} (bench/faults.py)")
    parser.add_argument("--out", type=Path, help=f"specs, logs and records (default runs/bench/{NAME}; "
                                                 f"with --smoke {SMOKE_RESULTS}/{NAME})")
    add_result_options(parser, NAME, "bench/e2e.py's small job, bagpipe alone at 1gbit")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root: network namespaces, veth and tc")
    args.modes = [m for m in (args.modes or ("bagpipe" if args.smoke else ",".join(MODES_RUN))).split(",") if m]
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    args.rates = [r for r in (args.rates or ("1gbit" if args.smoke else "1gbit,100mbit")).split(",") if r]
    for rate in args.rates:
        try:
            parse_rate(rate)
        except ConfigError as exc:
            parser.error(f"--rates: {exc}")
    try:
        args.fault = [parse_fault(text, HOSTS) for text in args.fault]
    except ConfigError as exc:
        parser.error(str(exc))
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    size = dataclasses.replace(size, iterations=args.iterations or size.iterations)
    if e2e.measured_of(size.iterations, size.max_ahead) < 2:
        parser.error(f"--iterations {size.iterations} leaves nothing to measure once the first fifth "
                     f"and the last {size.max_ahead} are left out")
    args.out = args.out or (SMOKE_RESULTS / NAME if args.smoke else Path("runs/bench") / NAME)
    args.with_torchrec, args.torchrec_skipped = e2e.torchrec_choice(parser, args.torchrec)
    return args, size


def main() -> int:
    args, size = parse_args()
    base = e2e.sections(size)
    names = [*args.modes, *([torchrec_baseline.MODE] if args.with_torchrec else [])]
    hide = args.hide_data.resolve() if args.hide_data else None
    results = {}
    try:
        for rate in args.rates:
            results[rate] = run_rate(rate, names, base, args.out.resolve(), hide, args.fault)
            print_rate(rate, results[rate], base)
    except BagpipeError as exc:
        print(f"cluster.py: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        return 128 + exc.signum
    if args.torchrec_skipped:
        print(f"(TorchRec skipped: {args.torchrec_skipped})")
    body = {rate: {name: {"summary": s.to_json(), "link_mb": r["links"][name]}
                   for name, s in r["summaries"].items()} for rate, r in results.items()}
    config = config_of(args, iterations=size.iterations, batch_size=size.batch, cache_rows=size.cache_rows,
                       warmup=e2e.warmup_of(size.iterations), cooldown=size.max_ahead)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"spec": base, "runs": body}, headline=headline(results), smoke=args.smoke)
    return 0


def headline(results: Mapping[str, Mapping[str, Any]]) -> Table:
    """Per rate and run: samples/s, hit rate, iteration time, and the MB a trainer host's
    link carried per measured iteration (sent + received by tr0)."""
    columns = ("rate", "mode", "samples/s", "hit rate %", "iteration ms", "tr0 link MB/iter")
    rows = []
    for rate, result in results.items():
        for name, s in result["summaries"].items():
            tr0 = result["links"][name]["per_iteration"]["tr0"]
            rows.append((rate, name, s.samples_per_s, 100 * s.hit_rate, 1e3 * s.iteration_time_s,
                         tr0["sent"] + tr0["received"]))
    return Table(columns, tuple(rows))


if __name__ == "__main__":
    sys.exit(main())
