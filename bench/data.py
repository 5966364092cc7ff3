"""Data pipeline throughput on this machine: raw parsing, conversion, batch reads, synthesis.

    python bench/data.py [--quick] [--json PATH]

The raw benchmark replicates the Criteo Kaggle 8k sample into a temporary file. Rates are
rows per wall second and per CPU second of this process (pyarrow may use a second thread).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.data.convert import convert  # noqa: E402
from common.data.dataset import open_dataset  # noqa: E402
from common.data.raw import RawReader  # noqa: E402
from common.data.spec import DataSpec  # noqa: E402
from common.data.synthetic import SyntheticGenerator  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "criteo_kaggle_head8000.tsv"


def timed(fn: Callable[[], int]) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    rows = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"rows": rows, "seconds": wall, "rows_per_s": rows / wall, "rows_per_cpu_s": rows / cpu}


def run(quick: bool, tmp: Path) -> dict[str, dict[str, float]]:
    copies = 25 if quick else 250  # 200k or 2M rows
    raw = tmp / "criteo.tsv"
    text = SAMPLE.read_bytes()
    with raw.open("wb") as f:
        for _ in range(copies):
            f.write(text)
    spec = DataSpec(format="criteo", path=str(raw))
    out: dict[str, dict[str, float]] = {}
    sum(len(c.labels) for c in RawReader(DataSpec(format="criteo", path=str(SAMPLE))).chunks())  # warm-up
    out["raw parse (criteo tsv)"] = timed(lambda: sum(len(c.labels) for c in RawReader(spec).chunks()))
    out["convert to preprocessed"] = timed(lambda: convert(spec, tmp / "pre", progress=False).rows)
    data = open_dataset(DataSpec(format="preprocessed", path=str(tmp / "pre")))
    epochs = 25 if quick else 20

    def read() -> int:
        n = 0
        for b in data.train_batches(4096, epochs=epochs):
            n += len(b.labels)  # b.sparse is already a fresh int64 copy: every byte was read
        return n

    read()  # warm the page cache: the figure is memory speed, not disk speed
    out["preprocessed batch read (B=4096)"] = timed(read)
    synth = SyntheticGenerator(DataSpec(format="synthetic", rows=200_000 if quick else 1_000_000))
    out["synthetic generate (26 tables)"] = timed(lambda: len(synth.rows(0, synth.num_rows).labels))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        results = run(args.quick, Path(tmp))
    print(f"{'stage':<34}{'rows':>11}{'seconds':>9}{'rows/s':>13}{'rows/cpu-s':>13}   ({os.cpu_count()} cores)")
    for name, r in results.items():
        print(f"{name:<34}{r['rows']:>11,}{r['seconds']:>9.2f}{r['rows_per_s']:>13,.0f}{r['rows_per_cpu_s']:>13,.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
