"""Data pipeline throughput on this machine: source readers, conversion, batch reads, synthesis.

    python bench/data.py [--quick] [--repeat N]

The raw benchmark replicates the Criteo Kaggle 8k sample into a temporary file; the same
rows are then written as TorchRec npy days (two, as ``tsv_to_npys`` lays them out) and as
one NVTabular-style parquet file (float32 dense, int64 ids, nulls for missing values), and
each reader is timed over them. Rates are rows per wall second and per CPU second of this
process (pyarrow may use a second thread); each stage runs `--repeat` times and the table
gives the median and the spread (lowest to highest rows/s, relative to the median).
`--smoke`: the sample once (8,000 rows), one run per stage, 10,000 synthetic rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.data.chunks import RawChunk, Reader  # noqa: E402
from common.data.convert import convert, open_reader  # noqa: E402
from common.data.dataset import open_dataset  # noqa: E402
from common.data.hashing import MISSING  # noqa: E402
from common.data.raw import CRITEO_COLUMNS, RawReader  # noqa: E402
from common.data.samples import CRITEO_KAGGLE  # noqa: E402
from common.data.spec import DataSpec  # noqa: E402
from common.data.synthetic import SyntheticGenerator  # noqa: E402

NAME = "data"
# Per size: copies of the 8,000-row sample, epochs of batch reads, synthetic rows.
SIZES = {"full": (250, 20, 1_000_000), "quick": (25, 25, 200_000), "smoke": (1, 1, 10_000)}


def timed(fn: Callable[[], int], repeat: int) -> dict[str, float | list[float]]:
    runs = []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        rows = fn()
        runs.append((rows, time.perf_counter() - wall, time.process_time() - cpu))
    rates = [r / w for r, w, _ in runs]
    return {
        "rows": runs[0][0], "seconds": statistics.median(w for _, w, _ in runs),
        "rows_per_s": statistics.median(rates), "rows_per_cpu_s": statistics.median(r / c for r, _, c in runs),
        "rows_per_s_runs": rates,
    }  # fmt: skip


def count(reader: Reader) -> int:
    return sum(len(c) for c in reader.chunks())


def write_npy_days(chunks: Iterator[RawChunk], rows: int, folder: Path, days: int = 2) -> None:
    """The rows as torchrec's tsv_to_npys writes them (float32 dense, int64 sparse with 0
    for missing, int32 [N, 1] labels), streamed into memmaps, split into `days` days."""
    folder.mkdir()
    per_day = -(-rows // days)
    done = 0
    for chunk in chunks:
        ids = chunk.ids.astype(np.int64)
        ids[chunk.ids == MISSING] = 0
        parts = {"labels": chunk.labels.astype(np.int32).reshape(-1, 1), "dense": chunk.dense, "sparse": ids}
        for name, part in parts.items():
            _append(folder, name, part, done, per_day, rows)
        done += len(chunk)


def _append(folder: Path, name: str, part: np.ndarray, done: int, per_day: int, rows: int) -> None:
    """Write rows [done, done + len(part)) of one array into the day files they fall in."""
    start = 0
    while start < len(part):
        day, offset = divmod(done + start, per_day)
        take = min(len(part) - start, per_day - offset)
        file = folder / f"day_{day}_{name}.npy"
        shape = (min(per_day, rows - day * per_day), *part.shape[1:])
        mode = "r+" if file.exists() else "w+"
        out = np.lib.format.open_memmap(file, mode=mode, dtype=part.dtype, shape=shape if mode == "w+" else None)
        out[offset : offset + take] = part[start : start + take]
        out.flush()
        start += take


def write_parquet(chunks: Iterator[RawChunk], path: Path) -> None:
    """NVTabular-style columns: label, I1..I13 float32, C1..C26 int64 with nulls for missing."""
    with pq.ParquetWriter(path, _parquet_schema()) as writer:
        for chunk in chunks:
            cols = [pa.array(chunk.labels.astype(np.int8))]
            cols += [pa.array(chunk.dense[:, j]) for j in range(13)]
            missing = chunk.ids == MISSING
            cols += [pa.array(chunk.ids[:, j].astype(np.int64), mask=missing[:, j]) for j in range(26)]
            writer.write_table(pa.Table.from_arrays(cols, schema=_parquet_schema()))


def _parquet_schema() -> pa.Schema:
    types = [pa.int8()] + [pa.float32()] * 13 + [pa.int64()] * 26
    return pa.schema(list(zip(CRITEO_COLUMNS, types, strict=True)))


def run(size: str, repeat: int, tmp: Path) -> dict[str, dict[str, float | list[float]]]:
    copies, epochs, synthetic_rows = SIZES[size]
    raw = tmp / "criteo.tsv"
    text = CRITEO_KAGGLE.read_bytes()
    with raw.open("wb") as f:
        for _ in range(copies):
            f.write(text)
    spec = DataSpec(format="criteo", path=str(raw))
    rows = copies * 8000
    write_npy_days(RawReader(spec).chunks(), rows, tmp / "days")
    write_parquet(RawReader(spec).chunks(), tmp / "criteo.parquet")
    npy = DataSpec(format="criteo-npy", path=str(tmp / "days"))
    parquet = DataSpec(format="parquet", path=str(tmp / "criteo.parquet"))
    out: dict[str, dict[str, float | list[float]]] = {}
    out["raw parse (criteo tsv)"] = timed(lambda: count(RawReader(spec)), repeat)
    out["npy days read (torchrec)"] = timed(lambda: count(open_reader(npy)), repeat)
    out["parquet read (nvtabular-style)"] = timed(lambda: count(open_reader(parquet)), repeat)
    out["convert tsv to preprocessed"] = timed(lambda: convert(spec, tmp / "pre", progress=False).rows, repeat)
    out["convert npy days"] = timed(lambda: convert(npy, tmp / "pre-npy", progress=False).rows, repeat)
    out["convert parquet"] = timed(lambda: convert(parquet, tmp / "pre-pq", progress=False).rows, repeat)
    data = open_dataset(DataSpec(format="preprocessed", path=str(tmp / "pre")))

    def read() -> int:
        n = 0
        for b in data.train_batches(4096, epochs=epochs):
            n += len(b.labels)  # b.sparse is already a fresh int64 copy: every byte was read
        return n

    read()  # warm the page cache: the figure is memory speed, not disk speed
    out["preprocessed batch read (B=4096)"] = timed(read, repeat)
    synth = SyntheticGenerator(DataSpec(format="synthetic", rows=synthetic_rows))
    out["synthetic generate (26 tables)"] = timed(lambda: len(synth.rows(0, synth.num_rows).labels), repeat)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    parser.add_argument("--repeat", type=int, help="runs per stage; the median is shown (default 3; 1 with --smoke)")
    add_result_options(parser, NAME, "the 8,000-row sample once, one run per stage")
    args = parser.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    repeat = args.repeat or (1 if args.smoke else 3)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        results = run(size, repeat, Path(tmp))
    print(f"{'stage':<34}{'rows':>11}{'seconds':>9}{'rows/s':>13}{'rows/cpu-s':>13}{'spread':>14}"
          f"   ({os.cpu_count()} cores, median of {repeat})")  # fmt: skip
    for name, r in results.items():
        print(f"{name:<34}{r['rows']:>11,}{r['seconds']:>9.2f}{r['rows_per_s']:>13,.0f}"
              f"{r['rows_per_cpu_s']:>13,.0f}{spread(r):>14}")  # fmt: skip
    copies, epochs, synthetic_rows = SIZES[size]
    config = config_of(args, repeat=repeat, sample_copies=copies, read_epochs=epochs, synthetic_rows=synthetic_rows)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config, figures={"stages": results},
                  headline=headline(results), smoke=args.smoke)
    return 0


def spread(r: dict) -> str:
    """The lowest and highest rows/s of a stage's runs, relative to their median."""
    runs = r["rows_per_s_runs"]
    return f"-{1 - min(runs) / r['rows_per_s']:.0%}/+{max(runs) / r['rows_per_s'] - 1:.0%}"


def headline(results: dict[str, dict]) -> Table:
    columns = ("stage", "rows", "seconds", "rows/s", "rows/CPU-s", "spread")
    return Table(columns, tuple((name, r["rows"], r["seconds"], r["rows_per_s"], r["rows_per_cpu_s"], spread(r))
                                for name, r in results.items()))


if __name__ == "__main__":
    sys.exit(main())
