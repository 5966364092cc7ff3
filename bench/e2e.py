#!/usr/bin/env python3
"""End-to-end throughput of every mode on the same data, model and cluster, in one run.

T = 2 trainers, S = 2 PS shards, DLRM, synthetic Criteo-like data (Criteo Kaggle's 26 table
cardinalities, 33.8 M rows, top 1% of rows = 92% of accesses), a cache far below the table
sizes. Prints samples/s, iteration time, hit rate and MB moved per iteration with ratios to
`local` and `no-cache`; `--json` writes them per mode, `--plot` a PNG.

    python bench/e2e.py --quick
    python bench/e2e.py --shaped 1gbit --json runs/bench/e2e.json     (root: PS behind a 1 Gbit/s link)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.job import build_job  # noqa: E402
from common.spec import MODES, load_spec, spec_toml  # noqa: E402
from launcher.cluster import run_cluster  # noqa: E402
from launcher.report import compare_modes, plot_modes, read_run, summarise  # noqa: E402

TOKEN = "e2e-bench"


def sections(iterations: int, batch: int, cache_rows: int) -> dict[str, dict]:
    return {
        "cluster": {"request_timeout_s": 120, "fetch_timeout_s": 300},
        "oracle": {"lookahead": 100, "prefetch_lead": 8, "cache_rows": cache_rows},
        "ps": {"shards": 2},
        "trainers": {"count": 2},
        "data": {"format": "synthetic", "rows": iterations * batch + 4096, "top1_share": 0.92},
        "model": {"name": "dlrm", "embedding_dim": 16, "bottom_mlp": [512, 256, 64, 16], "top_mlp": [512, 256]},
        "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adagrad", "dense_lr": 0.01},
        "train": {"batch_size": batch, "epochs": 1, "max_iterations": iterations},
    }


def run_mode(mode: str, base: dict, out: Path, ps_host) -> dict:
    spec_path = out / f"{mode}.toml"
    spec_path.write_text(spec_toml(f"e2e-{mode}", 3, {**base, "oracle": {**base["oracle"], "mode": mode}}))
    job = build_job(load_spec(spec_path))
    run_dir = out / mode
    print(f"running {mode} ...", file=sys.stderr, flush=True)
    run_cluster(job, run_dir, token=TOKEN, ps_host=ps_host)
    iterations = job.spec.train.max_iterations
    return summarise(read_run(run_dir, 2), mode=mode, global_batch=job.spec.train.batch_size,
                     warmup=max(2, iterations // 5), trainers=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller iterations (a few minutes)")
    parser.add_argument("--iterations", type=int, help="iterations per mode (default 40 quick, 150 full)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes")
    parser.add_argument("--shaped", metavar="RATE", help="put the PS behind a veth link shaped to RATE (e.g. 1gbit); root")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--plot", type=Path, help="write a PNG comparing the modes here")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/e2e"), help="specs, logs and records")
    args = parser.parse_args()
    iterations = args.iterations or (40 if args.quick else 150)
    batch, cache_rows = (2048, 32768) if args.quick else (4096, 65536)
    base = sections(iterations, batch, cache_rows)
    args.out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    shaping = contextlib.nullcontext(None)
    if args.shaped:
        from bench.netshape import shaped_ps_host

        shaping = shaped_ps_host(args.shaped)
    with shaping as ps_host:
        summaries = {mode: run_mode(mode, base, args.out, ps_host) for mode in modes}
    link = f"PS behind a {args.shaped} tbf-shaped veth link" if args.shaped else "loopback, unshaped"
    print(f"\n{iterations} iterations per mode, global batch {batch}, C = {cache_rows} rows per trainer, {link}")
    print(compare_modes(summaries))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        per_mode = {m: {"samples_per_s": s.samples_per_s, "hit_rate": s.hit_rate,
                        "fetch_bytes_per_iter": s.fetch_bytes_per_iter, "sync_bytes_per_iter": s.sync_bytes_per_iter,
                        "write_back_bytes_per_iter": s.write_back_bytes_per_iter,
                        "iteration_time_s": s.iteration_time_s, "phase_s": s.phase_s} for m, s in summaries.items()}
        meta = {"iterations": iterations, "batch_size": batch, "cache_rows": cache_rows, "shaped": args.shaped}
        args.json.write_bytes(orjson.dumps({"config": meta, "modes": per_mode}, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    if args.plot:
        plot_modes(summaries, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
