"""The CUDA path, checked and measured where a GPU is available (docs/design.md#cache-and-overlap).

1. **Exactness on CUDA.** Every mode runs in one process (`launcher/inprocess.py`, one trainer
   on the GPU, deterministic kernels) and must end bit-identical to every other mode.
2. **End to end.** A local cluster per mode (oracle, PS shards and one trainer process on the
   GPU over HTTP/2): samples/s, hit rate, machinery per iteration.
3. **Overlap.** A torch.profiler trace of a bagpipe run: how many host-to-device copies of
   fetched rows ran on the side stream while a compute kernel ran, and for how long.

    python bench/gpu_check.py [--iterations 60]
    python bench/gpu_check.py --device cpu      (the same script on the CPU: a dry run)

Exits 2 when CUDA is asked for and torch sees no GPU. `--smoke` checks and measures a small
job (8 iterations of 64 on tables of 1,000 rows, a small model; the clusters of bagpipe alone).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if not __package__:  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.job import Job, build_job  # noqa: E402
from common.spec import MODES, load_spec, spec_toml  # noqa: E402
from launcher.cluster import run_cluster  # noqa: E402
from launcher.inprocess import InProcessRun, run_in_process  # noqa: E402
from launcher.summary import summarise  # noqa: E402
from trainer.device import deterministic_kernels  # noqa: E402
from trainer.records import read_run  # noqa: E402

NAME = "gpu_check"
TOKEN = "gpu-check"
MODEL = {"name": "dlrm", "embedding_dim": 64, "bottom_mlp": [512, 256, 64], "top_mlp": [1024, 1024, 512, 256]}
SMOKE_MODEL = {"name": "dlrm", "embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16]}


def job_for(directory: Path, mode: str, *, device: str, iterations: int, batch: int, smoke: bool = False) -> Job:
    """The checked job; with `smoke`, tables of 1,000 rows and a small model."""
    sections: dict[str, dict[str, Any]] = {
        "oracle": {"mode": mode, "lookahead": 50, "prefetch_lead": 4, "cache_rows": 4096 if smoke else 16384},
        "ps": {"shards": 2},
        "trainers": {"count": 1, "device": device},
        # 26 tables of 100,000 rows: local mode holds them all in every trainer.
        "data": {"format": "synthetic", "rows": iterations * batch + 4096, "top1_share": 0.92,
                 "table_sizes": [1000 if smoke else 100_000] * 26},
        "model": SMOKE_MODEL if smoke else MODEL,
        "optimizer": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adagrad", "dense_lr": 0.01},
        "train": {"batch_size": batch, "epochs": 1, "max_iterations": iterations},
        "checkpoint": {"dir": str(directory / "checkpoints")},
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{mode}.toml"
    path.write_text(spec_toml(f"gpu-{mode}", 5, sections))
    return build_job(load_spec(path))


def check_exactness(directory: Path, device: str, iterations: int, batch: int, smoke: bool = False) -> dict[str, Any]:
    runs = {mode: run_in_process(job_for(directory, mode, device=device, iterations=iterations, batch=batch,
                                         smoke=smoke), device)
            for mode in MODES}
    first = runs[MODES[0]].model
    differing = {mode: _differing(run, first) for mode, run in runs.items()}
    return {"identical": all(not d for d in differing.values()), "differing_elements": differing}


def _differing(run: InProcessRun, want: Any) -> int:
    got = run.model
    count = sum(int((got.dense[k] != v).sum()) for k, v in want.dense.items())
    return count + int(np.count_nonzero(got.table != want.table)) + int(np.count_nonzero(got.state != want.state))


def measure_clusters(
    directory: Path, device: str, iterations: int, batch: int, modes: tuple[str, ...] = MODES, smoke: bool = False
) -> dict[str, Any]:
    out = {}
    for mode in modes:
        job = job_for(directory / mode, mode, device=device, iterations=iterations, batch=batch, smoke=smoke)
        run_cluster(job, directory / mode / "run", token=TOKEN)
        s = summarise(read_run(directory / mode / "run", 1), mode=mode, global_batch=batch,
                      warmup=max(2, iterations // 5), trainers=1)
        out[mode] = {"samples_per_s": s.samples_per_s, "hit_rate": s.hit_rate, "machinery_ms": 1e3 * s.machinery_s,
                     "phase_ms": {p: 1e3 * v for p, v in s.phase_s.items()}}
    return out


def measure_overlap(directory: Path, device: str, iterations: int, batch: int, smoke: bool = False) -> dict[str, Any]:
    """Copies (host to device) that overlapped a kernel on another stream, from a trace."""
    from torch.profiler import ProfilerActivity, profile

    job = job_for(directory, "bagpipe", device=device, iterations=iterations, batch=batch, smoke=smoke)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run_in_process(job, device)
    copies, kernels = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end, event.device_resource_id)
        (copies if "HtoD" in event.name else kernels).append(span)
    overlapped_us = 0.0
    overlapping = 0
    for start, end, stream in copies:
        shared = sum(max(0.0, min(end, k_end) - max(start, k_start))
                     for k_start, k_end, k_stream in kernels if k_stream != stream)
        if shared > 0:
            overlapping += 1
            overlapped_us += min(shared, end - start)
    copy_us = sum(end - start for start, end, _ in copies)
    return {"copies": len(copies), "copies_overlapping_a_kernel": overlapping,
            "copy_ms": copy_us / 1e3, "overlapped_ms": overlapped_us / 1e3, "kernels": len(kernels)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--iterations", type=int, help="iterations of the clusters (default 60; 8 with --smoke)")
    parser.add_argument("--batch", type=int, help="batch of the clusters and the trace (default 2048; 64 with --smoke)")
    add_result_options(parser, NAME, "8 iterations of 64, small tables and model, the clusters of bagpipe alone")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing to check (try --device cpu for a dry run)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        deterministic_kernels()  # before any CUDA work: cuBLAS reads its workspace setting once
    smoke = args.smoke
    iterations, batch = args.iterations or (8 if smoke else 60), args.batch or (64 if smoke else 2048)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        started = time.perf_counter()
        result["exactness"] = check_exactness(directory / "exact", args.device, min(iterations, 40),
                                              64 if smoke else 256, smoke)
        print(f"1. every mode bit-identical on {args.device}: {result['exactness']['identical']} "
              f"(differing elements against {MODES[0]}: {result['exactness']['differing_elements']})", flush=True)
        modes = ("bagpipe",) if smoke else MODES
        result["clusters"] = measure_clusters(directory / "e2e", args.device, iterations, batch, modes, smoke)
        print(f"2. local clusters, one trainer on {args.device}, batch {batch}:")
        print(f"   {'mode':<14}{'samples/s':>12}{'hit rate':>10}{'machinery ms':>14}")
        for mode, m in result["clusters"].items():
            print(f"   {mode:<14}{m['samples_per_s']:>12,.0f}{100 * m['hit_rate']:>9.1f}%{m['machinery_ms']:>14.2f}")
        overlap = measure_overlap(directory / "trace", args.device, min(iterations, 30), batch, smoke)
        result["overlap"] = overlap
        print(f"3. {overlap['copies']} host-to-device copies ({overlap['copy_ms']:.2f} ms), "
              f"{overlap['copies_overlapping_a_kernel']} overlapping a kernel on another stream "
              f"({overlap['overlapped_ms']:.2f} ms overlapped), {overlap['kernels']} kernels")
        result["seconds"] = time.perf_counter() - started
    config = config_of(args, iterations=iterations, batch=batch, modes=modes)
    write_results(results_path(NAME, args.json, smoke), bench=NAME, config=config, figures=result,
                  headline=headline(result), smoke=smoke)
    return 0 if result["exactness"]["identical"] else 1


def headline(result: dict[str, Any]) -> Table:
    """Per cluster mode: samples/s, hit rate and machinery on the device, beside whether every
    mode ended bit-identical and how many host-to-device copies overlapped a kernel."""
    columns = ("device", "mode", "samples/s", "hit rate %", "machinery ms", "modes bit-identical", "copies overlapped")
    overlap = f"{result['overlap']['copies_overlapping_a_kernel']} of {result['overlap']['copies']}"
    return Table(columns, tuple((result["device"], mode, m["samples_per_s"], 100 * m["hit_rate"], m["machinery_ms"],
                                 result["exactness"]["identical"], overlap)
                                for mode, m in result["clusters"].items()))


if __name__ == "__main__":
    sys.exit(main())
