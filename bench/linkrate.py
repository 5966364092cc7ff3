#!/usr/bin/env python3
"""What the links of a `bench/topology.py` topology carry: TCP flows that saturate them, their
traffic counted on the links over a window, and a probe of what tbf holds on this machine.

    python bench/linkrate.py --probe 20mbit,1gbit,10gbit [--mtu 9000] [--window 3]

The probe builds hosts a (shaped), b and c (unshaped) and prints, per rate, what a sent to b
and received from b, counted on a's link over the window, beside what the unshaped b to c
carried: where that is below a rate, the machine, not the tbf, is the limit. Needs root.
`--smoke` probes 1gbit alone, counting 0.3 s after 0.3 s of ramp-up.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

if not __package__:  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from bench.topology import HostSpec, Topology, TopologyError, Traffic, parse_rate, stop_processes  # noqa: E402

NAME = "linkrate"
SINK_PORT = 5201


@contextlib.contextmanager
def flows(net: Topology, pairs: Sequence[tuple[str, str]], *, port: int = SINK_PORT) -> Iterator[None]:
    """While inside, each (sender, receiver) pair streams TCP as fast as it can; the
    processes (this file's --sink and --source) stop on leaving."""
    me = [sys.executable, str(Path(__file__).resolve())]
    started = []
    try:
        for receiver in sorted({r for _, r in pairs}):
            started.append(net[receiver].popen([*me, "--sink", str(port)]))
        for sender, receiver in pairs:
            started.append(net[sender].popen([*me, "--source", f"{net[receiver].address}:{port}"]))
        yield
    finally:
        stop_processes(started[::-1], grace_s=1.0)  # the sources first: a sink gone first breaks their pipes


def measure(
    net: Topology, pairs: Sequence[tuple[str, str]], *, window_s: float, settle_s: float = 1.0
) -> Traffic:
    """The links' traffic over `window_s` while `pairs` stream, after `settle_s` in which the
    connections open, TCP ramps up and the buckets drain their first burst."""
    with flows(net, pairs):
        time.sleep(settle_s)
        before = net.snapshot()
        time.sleep(window_s)
        return net.snapshot() - before


def _sink(port: int) -> None:
    """Accept connections on `port` and throw away what they send, until killed."""
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_drain, args=(conn,), daemon=True).start()


def _drain(conn: socket.socket) -> None:
    with conn:
        while conn.recv(1 << 20):
            pass


def _source(address: str) -> None:
    """Send zeros to `address` (HOST:PORT) as fast as it takes them, until killed; retries
    the connection while the sink is starting."""
    host, _, port = address.rpartition(":")
    for _ in range(100):
        try:
            conn = socket.create_connection((host, int(port)))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    else:
        raise TopologyError(f"no sink at {address}")
    buf = bytes(1 << 20)
    with contextlib.suppress(ConnectionError):  # the sink went away: the flow is over
        while True:
            conn.sendall(buf)


def probe(rates: Sequence[str], *, mtu: int, window_s: float, settle_s: float = 1.0) -> list[dict[str, float | str]]:
    """What tbf holds here: per rate ("none" first: an unshaped link), a shaped host's send
    and receive rates in bits/s, counted on its link over `window_s`."""
    unshaped = [HostSpec(name="b"), HostSpec(name="c")]
    with Topology([HostSpec(name="a"), *unshaped], mtu=mtu) as net:
        t = measure(net, [("b", "c")], window_s=window_s, settle_s=settle_s)
        rows: list[dict[str, float | str]] = [
            {"rate": "none", "sent_bps": _bps(t.links["b"].sent, t), "received_bps": _bps(t.links["c"].received, t)}]
    for rate in rates:
        with Topology([HostSpec(name="a", rate=rate), *unshaped], mtu=mtu) as net:
            out = measure(net, [("a", "b")], window_s=window_s, settle_s=settle_s)
            into = measure(net, [("b", "a")], window_s=window_s, settle_s=settle_s)
        limit = parse_rate(rate)
        sent, received = _bps(out.links["a"].sent, out), _bps(into.links["a"].received, into)
        rows.append({"rate": rate, "limit_bps": limit, "sent_bps": sent, "received_bps": received,
                     "sent_over_limit": sent / limit, "received_over_limit": received / limit})
    return rows


def probe_table(rows: Sequence[dict[str, float | str]], *, mtu: int, window_s: float) -> str:
    lines = [f"MTU {mtu}, {window_s:g} s windows, rates counted on the link (Ethernet headers included)",
             f"{'limit':>10}{'sent Gbit/s':>14}{'recv Gbit/s':>14}{'sent/limit':>12}{'recv/limit':>12}"]
    for r in rows:
        line = f"{r['rate']:>10}{float(r['sent_bps']) / 1e9:>14.3f}{float(r['received_bps']) / 1e9:>14.3f}"
        if "limit_bps" in r:
            line += f"{r['sent_over_limit']:>12.3f}{r['received_over_limit']:>12.3f}"
        lines.append(line)
    return "\n".join(lines)


def headline(rows: Sequence[dict[str, float | str]]) -> Table:
    columns = ("limit", "sent Gbit/s", "received Gbit/s", "sent / limit", "received / limit")
    return Table(columns, tuple((r["rate"], float(r["sent_bps"]) / 1e9, float(r["received_bps"]) / 1e9,
                                 r.get("sent_over_limit"), r.get("received_over_limit")) for r in rows))


def _bps(nbytes: int, t: Traffic) -> float:
    return 8 * nbytes / t.seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--probe", metavar="RATES", help="comma-separated tc rates: measure what tbf holds at each "
                                                        "(1gbit with --smoke)")
    what.add_argument("--sink", type=int, help=argparse.SUPPRESS)  # the two ends of a flow
    what.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the links")
    parser.add_argument("--window", type=float, help="seconds each rate is counted (default 3; 0.3 with --smoke)")
    add_result_options(parser, NAME, "1gbit alone, 0.3 s windows")
    args = parser.parse_args(argv)
    if args.sink is not None:
        _sink(args.sink)
    elif args.source is not None:
        _source(args.source)
    elif args.probe or args.smoke:
        rates = [r for r in (args.probe or "1gbit").split(",") if r]
        window, settle = args.window or (0.3 if args.smoke else 3.0), 0.3 if args.smoke else 1.0
        rows = probe(rates, mtu=args.mtu, window_s=window, settle_s=settle)
        print(probe_table(rows, mtu=args.mtu, window_s=window))
        config = config_of(args, rates=rates, window=window, settle_s=settle)
        write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config, figures={"rates": rows},
                      headline=headline(rows), smoke=args.smoke)
    else:
        parser.error("say what to do: --probe RATES (or --smoke)")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
