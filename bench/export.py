"""Export benchmark: speed and peak memory of ``launch.py export`` on Criteo Kaggle-sized
tables (26 tables, 33.8 M rows of 16 floats: 2.16 GB).

    .venv/bin/python bench/export.py [--dir DIR] [--written 0.1] [--tables N]

Lays out in DIR a local-mode run's final model (the whole table in one array) and a
two-shard checkpoint whose snapshots hold `--written` of the rows (the rest are initial
values, which the export generates as it streams), then runs ``launch.py export`` on each in
a subprocess under GNU time: wall time, MB/s of safetensors written, and peak resident
memory, beside the same command on a model of 100-row tables (the interpreter, torch and the
dense model: what the tables add is the difference). The sources were just written, so they
are read from the page cache; each output file is fsynced before it is renamed.
`--smoke`: the first 2 tables (2,043 rows), without the 100-row baseline: two exports.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.checkpoints import dense_path, final_paths, ps_dir, write_manifest  # noqa: E402
from common.data.spec import CRITEO_KAGGLE_SIZES  # noqa: E402
from common.job import Job, build_job  # noqa: E402
from common.spec import load_spec, spec_toml  # noqa: E402
from ps.checkpoint import save_snapshot  # noqa: E402
from ps.store import Snapshot  # noqa: E402
from serving.export import DEFAULT_CHUNK_MB  # noqa: E402
from trainer.models import build_model  # noqa: E402

NAME = "export"
ROOT = Path(__file__).resolve().parents[1]
SHARDS, CHECKPOINT, FILL_ROWS = 2, 0, 1 << 20


@dataclass(frozen=True, kw_only=True)
class Measured:
    source: str
    table_bytes: int
    seconds: float  # as export reports it: opening the sources and writing the files
    mb_per_s: float  # safetensors bytes written per second
    peak_rss_mb: float


def write_spec(directory: Path, name: str, sizes: tuple[int, ...]) -> Path:
    sections = {
        "ps": {"shards": SHARDS}, "trainers": {"count": 1},
        "data": {"format": "synthetic", "rows": 1000, "table_sizes": list(sizes)},
        "model": {"name": "dlrm"}, "train": {"batch_size": 256},
        "checkpoint": {"dir": str(directory / name / "checkpoints")},
    }  # fmt: skip
    path = directory / f"{name}.toml"
    path.write_text(spec_toml(name, 1, sections))
    return path


def lay_out(job: Job, run_dir: Path, written: float, rng: np.random.Generator) -> None:
    """A local-mode run's final model and checkpoint CHECKPOINT, written a chunk at a time."""
    total, dim = job.layout.total_rows, job.dim
    dense = build_model(job.model, job.num_dense, job.layout.num_tables).state_dict()
    paths = final_paths(run_dir)
    paths.dense.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dense, paths.dense)
    table = np.lib.format.open_memmap(paths.table, mode="w+", dtype=np.float32, shape=(total, dim))
    for start in range(0, total, FILL_ROWS):
        stop = min(start + FILL_ROWS, total)
        table[start:stop] = rng.standard_normal((stop - start, dim), dtype=np.float32)
    table.flush()
    del table
    paths.info.write_bytes(orjson.dumps({"iterations": 1, "ps_checkpoint": None}))
    directory = job.spec.checkpoint.dir
    for s in range(SHARDS):
        shard_rows = (total - s + SHARDS - 1) // SHARDS
        local = np.sort(rng.choice(shard_rows, int(shard_rows * written), replace=False))
        snap = Snapshot(local=local, rows=rng.standard_normal((len(local), dim), dtype=np.float32),
                        state=np.zeros((len(local), 1), np.float32), versions=np.zeros(len(local), np.int64))
        save_snapshot(ps_dir(directory, s), CHECKPOINT, snap, {"shard": s, "num_shards": SHARDS})
    dense_path(directory, CHECKPOINT).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": dense, "optimizer": {}, "iteration": CHECKPOINT}, dense_path(directory, CHECKPOINT))
    write_manifest(directory, CHECKPOINT, SHARDS, {})


def export(spec: Path, out: Path, source: list[str], chunk_mb: float, table_bytes: int, label: str) -> Measured:
    """`launch.py export` under GNU time: the seconds it reports for opening and writing the
    files (start-up left out), the bytes of model.safetensors per second, and the process's
    peak RSS."""
    command = ["/usr/bin/time", "-f", "%M", sys.executable, str(ROOT / "launch.py"), "export", str(spec),
               *source, "--out", str(out), "--chunk-mb", str(chunk_mb)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    peak_kb = int(done.stderr.strip().splitlines()[-1])
    seconds = float(done.stdout.split(" in ", 1)[1].split(" s ", 1)[0])
    written = (out / "model.safetensors").stat().st_size
    # export prints hundredths of a second: an export faster than that has no rate to tell
    rate = written / seconds / 1e6 if seconds > 0 else math.nan
    return Measured(source=label, table_bytes=table_bytes, seconds=seconds, mb_per_s=rate, peak_rss_mb=peak_kb / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to lay the runs out (default: a temporary folder)")
    parser.add_argument("--written", type=float, default=0.1, help="share of rows in the snapshots (0.1)")
    parser.add_argument("--tables", type=int, help="the first N Criteo Kaggle tables (default 26; 2 with --smoke)")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB,
                        help="export's --chunk-mb (%(default)s)")
    add_result_options(parser, NAME, "the first 2 tables, no 100-row baseline")
    args = parser.parse_args()
    tables = args.tables or (2 if args.smoke else 26)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory, rng = Path(tmp), np.random.default_rng(0)
        results = []
        models = {"tiny": (100,) * tables, "criteo": CRITEO_KAGGLE_SIZES[:tables]}
        if args.smoke:
            del models["tiny"]  # each export is a process importing torch: the most of a smoke run
        for name, sizes in models.items():
            spec = write_spec(directory, name, sizes)
            job = build_job(load_spec(spec))
            run_dir = directory / name / "run"
            lay_out(job, run_dir, args.written, rng)
            table_bytes = job.layout.total_rows * job.dim * 4
            sources = {f"{name}: local-mode final table": ["--run-dir", str(run_dir)],
                       f"{name}: checkpoint, {args.written:.0%} of rows written": ["--checkpoint", "latest"]}
            for label, source in sources.items():
                out = directory / f"{name}-{source[0]}"
                results.append(export(spec, out, source, args.chunk_mb, table_bytes, label))
                shutil.rmtree(out)  # keep the disk it needs to one export at a time
    print(f"{'source':<44}{'tables MB':>11}{'seconds':>9}{'MB/s':>8}{'peak RSS MB':>13}")
    for r in results:
        print(f"{r.source:<44}{r.table_bytes / 1e6:>11,.1f}{r.seconds:>9.2f}{r.mb_per_s:>8.1f}"
              f"{r.peak_rss_mb:>13.0f}")
    config = config_of(args, tables=tables, shards=SHARDS)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"rows": [asdict(r) for r in results]}, headline=headline(results), smoke=args.smoke)


def headline(results: list[Measured]) -> Table:
    columns = ("source", "tables MB", "seconds", "MB/s", "peak RSS MB")
    return Table(columns, tuple((r.source, r.table_bytes / 1e6, r.seconds, r.mb_per_s, r.peak_rss_mb)
                                for r in results))


if __name__ == "__main__":
    main()
