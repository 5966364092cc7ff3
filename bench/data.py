"""Data pipeline throughput on this machine: source readers, conversion at 1 and 2 workers, batch reads, synthesis.

    python bench/data.py [--quick] [--size 10GB] [--repeat N]

The reader benchmark replicates the Criteo Kaggle 8k sample into a temporary file; the
same rows are then written as TorchRec npy days (two, as ``tsv_to_npys`` lays them out) and
as one NVTabular-style parquet file (float32 dense, int64 ids, nulls for missing values),
and each reader is timed over them (npy days and parquet are read in place by training;
their conversions are what skip mode or a dictionary costs).

The conversion benchmark writes Criteo-format text with the synthetic generator, as 4 day
files (`--size` bytes in all; by default 1.2 M rows with --quick, 4.8 M without), converts
it with 1 worker and with 2, then gzipped with 1, and opens it for training while it
converts (the time to the first batch). Rates are rows per wall second and per CPU second
of the converting process (a new one, as `launch.py` is: its start, imports and numba's
cache included), the server its workers fork from and the workers; peak RSS is summed over
them, sampled every 0.1 s (pages they share count in each; PSS, which splits them, is in
the JSON); `cores_busy` is their CPU seconds per wall second (fewer than the workers: they
waited, on the disk or on each other). The conversions with 1 and 2 workers run in turn,
and the speed-up is the median of the pairs' (with its range). Each stage runs `--repeat`
times (at `--size`, once unless `--repeat` says otherwise) and the table gives the median
and the spread (lowest to highest rows/s, relative to the median).
`--smoke`: the sample once (8,000 rows), one run per stage, 10,000 synthetic rows, 40,000
rows of text.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.data.chunks import RawChunk, Reader  # noqa: E402
from common.data.convert import convert, open_reader  # noqa: E402
from common.data.dataset import cache_path, open_dataset  # noqa: E402
from common.data.hashing import MISSING  # noqa: E402
from common.data.raw import CRITEO_COLUMNS, RawReader  # noqa: E402
from common.data.samples import CRITEO_KAGGLE  # noqa: E402
from common.data.spec import DataSpec  # noqa: E402
from common.data.synthetic import SyntheticGenerator  # noqa: E402

NAME = "data"
# Per size: copies of the 8,000-row sample, epochs of batch reads, synthetic rows, rows of
# synthetic Criteo text for the conversion benchmark (unless --size says otherwise).
SIZES = {"full": (250, 20, 1_000_000, 4_800_000), "quick": (25, 25, 200_000, 1_200_000),
         "smoke": (1, 1, 10_000, 40_000)}  # fmt: skip
DAYS = 4  # files of the conversion benchmark's text
TEXT_CHUNK = 1 << 16  # rows generated and written at a time


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


def parse_size(text: str) -> int:
    """'10GB', '500MB', '2.5GiB', '1e9' → bytes (GB = 10**9, GiB = 2**30)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 10GB or 500MB)")
    unit = (match.group(2) or "").lower()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    return int(float(match.group(1)) * scale[unit])


def criteo_text(rows_from: Callable[[int], object], first: int, n: int, seed: int) -> bytes:
    """Rows ``[first, first + n)`` of the synthetic generator as Criteo TSV lines: the
    label, 13 counts (expm1 of the dense features; 10 % missing), 26 values of 8 hex digits
    (each table's rows spread over 32 bits; 44 % missing in C19, C20, C25 and C26 and 5 %
    elsewhere, as in Criteo's data)."""
    r = rows_from(first)  # type: ignore[operator]
    rng = np.random.default_rng([seed, first])
    counts = np.rint(np.expm1(r.dense.astype(np.float64))).astype(np.int64)
    counts[rng.random(counts.shape) < 0.1] = -1
    values = ((r.sparse.astype(np.uint64) * np.uint64(2654435761) + np.arange(26, dtype=np.uint64) * np.uint64(40503))
              % np.uint64(2**32))  # fmt: skip
    missing = rng.random(values.shape) < np.where(np.isin(np.arange(26), [18, 19, 24, 25]), 0.44, 0.05)
    values[missing] = np.uint64(2**32)  # no such 32-bit value: written as an empty field
    out = np.empty(n * (2 + 13 * 21 + 26 * 9 + 1), dtype=np.uint8)
    return bytes(out[: _format_criteo(r.labels.astype(np.uint8), counts, values, out)])


def _format_criteo(labels: np.ndarray, counts: np.ndarray, values: np.ndarray, out: np.ndarray) -> int:
    from common.numba_cache import use_user_cache

    use_user_cache()
    import numba

    global _format_kernel
    if _format_kernel is None:
        _format_kernel = numba.njit(cache=True, nogil=True)(_format_lines)
    return int(_format_kernel(labels, counts, values, out))


_format_kernel = None


def _format_lines(labels: np.ndarray, counts: np.ndarray, values: np.ndarray, out: np.ndarray) -> int:
    hexdigits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    digits = np.empty(20, dtype=np.uint8)
    p = 0
    for i in range(len(labels)):
        out[p] = 48 + labels[i]
        p += 1
        for j in range(13):
            out[p] = 9
            p += 1
            v = counts[i, j]
            if v < 0:
                continue
            k = 0
            while True:
                digits[k] = 48 + v % 10
                v //= 10
                k += 1
                if v == 0:
                    break
            for q in range(k - 1, -1, -1):
                out[p] = digits[q]
                p += 1
        for j in range(26):
            out[p] = 9
            p += 1
            v = values[i, j]
            if v >= 2**32:
                continue
            for q in range(7, -1, -1):
                out[p + q] = hexdigits[v & 15]
                v >>= 4
            p += 8
        out[p] = 10
        p += 1
    return p


def write_criteo_days(folder: Path, *, rows: int | None, size: int | None) -> tuple[list[Path], int]:
    """`DAYS` Criteo TSV files of synthetic rows, `rows` of them or `size` bytes in all
    (rounded to whole chunks of lines); the files and the rows written."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = SyntheticGenerator(DataSpec(format="synthetic", rows=2**40))
    files = [folder / f"day_{d}.tsv" for d in range(DAYS)]
    done = 0
    per_file = None if rows is None else -(-rows // DAYS)
    for file in files:
        with file.open("wb") as f:
            here = written = 0
            while (per_file is not None and here < per_file) or (size is not None and written < size // DAYS):
                n = TEXT_CHUNK if per_file is None else min(TEXT_CHUNK, per_file - here)
                text = criteo_text(lambda first, n=n: gen.rows(first, first + n), done, n, seed=7)
                f.write(text)
                written += len(text)
                done, here = done + n, here + n
    return files, done


class PeakRss:
    """The peaks of the summed RSS and PSS (shared pages split between their users) of a
    process and its descendants, sampled every 0.1 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_rss, self.peak_pss = pid, 0, 0
        self.cpu_s: dict[int, float] = {}  # the last CPU time seen of each process of the family
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            family = _family(self.pid)
            self.peak_rss = max(self.peak_rss, sum(_memory(pid, "/proc/{}/status", "VmRSS:") for pid in family))
            self.peak_pss = max(self.peak_pss, sum(_memory(pid, "/proc/{}/smaps_rollup", "Pss:") for pid in family))
            for pid in family:
                self.cpu_s[pid] = max(self.cpu_s.get(pid, 0.0), _cpu_of(pid))
            self._stop.wait(0.1)

    def descendants_cpu_s(self) -> float:
        """CPU seconds of the family but its head (as last seen: up to 0.1 s short each)."""
        return sum(cpu for pid, cpu in self.cpu_s.items() if pid != self.pid)


def _family(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return pids


def _memory(pid: int, file: str, key: str) -> int:
    try:
        for line in Path(file.format(pid)).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_of(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


_CONVERT = """
import json, resource, sys, time
from pathlib import Path
from common.data.convert import Conversion
from common.data.dataset import open_dataset
from common.data.spec import DataSpec
args = json.loads(sys.argv[1])
spec = DataSpec(**args["spec"])
started = time.perf_counter()
if args["first_batch"]:
    data = open_dataset(spec, background=True)
    next(data.train_batches(4096))
    first = time.perf_counter() - started
    if getattr(data, "conversion", None) is not None:
        data.conversion.join()
    body = {"rows": data.num_rows, "first_batch_s": first}
else:
    job = Conversion(spec, Path(args["out"]), workers=args["workers"])
    body = {"rows": job.run().rows, "worker_cpu_s": job.worker_cpu_s}
own = resource.getrusage(resource.RUSAGE_SELF)
body |= {"seconds": time.perf_counter() - started, "own_cpu_s": own.ru_utime + own.ru_stime}
print(json.dumps(body))
"""


def _converted_in_a_process(spec: DataSpec, workers: int, *, first_batch: bool = False) -> dict:
    """Convert `spec` from nothing in a process of its own (what `launch.py` or
    ``python -m common.data convert`` would be): its figures, and the peak memory of it,
    the server its workers fork from and the workers."""
    out = cache_path(spec)
    shutil.rmtree(out, ignore_errors=True)
    fields = {k: v for k, v in vars(spec).items() if k in ("format", "path", "cache_dir")} | {"workers": workers}
    args = {"spec": fields, "out": str(out), "workers": workers, "first_batch": first_batch}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _CONVERT, orjson.dumps(args).decode()], stdout=subprocess.PIPE,
                            env=env)  # fmt: skip
    with PeakRss(proc.pid) as memory:
        stdout, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the conversion exited with {proc.returncode}")
    body = orjson.loads(stdout.splitlines()[-1])
    return body | {"peak_rss_mb": memory.peak_rss / 2**20, "peak_pss_mb": memory.peak_pss / 2**20,
                   "cpu_s": body["own_cpu_s"] + memory.descendants_cpu_s(), "disk_bytes": _disk_bytes(out)}  # fmt: skip


def timed_conversion(spec: DataSpec, workers: int, repeat: int) -> dict[str, float | list[float]]:
    """Convert `spec` from nothing `repeat` times with `workers` processes."""
    return conversion_stage([_converted_in_a_process(spec, workers) for _ in range(repeat)], workers)


def conversion_stage(runs: list[dict], workers: int) -> dict[str, float | list[float]]:
    """A conversion stage's figures from its runs (`_converted_in_a_process`): medians, and
    `cores_busy`, the CPU seconds per wall second (below the workers, they waited: on the
    disk, or on each other)."""
    rates = [r["rows"] / r["seconds"] for r in runs]
    return {
        "rows": runs[0]["rows"], "seconds": statistics.median(r["seconds"] for r in runs), "workers": workers,
        "rows_per_s": statistics.median(rates),
        "rows_per_cpu_s": statistics.median(r["rows"] / r["cpu_s"] for r in runs),
        "cores_busy": statistics.median(r["cpu_s"] / r["seconds"] for r in runs),
        "rows_per_s_runs": rates, "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "peak_pss_mb": max(r["peak_pss_mb"] for r in runs), "disk_bytes": runs[0]["disk_bytes"],
    }  # fmt: skip


def paired_conversions(spec: DataSpec, repeat: int) -> dict[str, dict]:
    """`spec` converted with 1 worker then 2, `repeat` times in turn, so that a machine whose
    speed drifts moves both of a pair alike; the speed-up is the median of the pairs'."""
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(repeat):
        for workers, done in runs.items():
            done.append(_converted_in_a_process(spec, workers))
    one, two = (conversion_stage(done, workers) for workers, done in runs.items())
    two["speedups"] = [b["rows"] / b["seconds"] / (a["rows"] / a["seconds"]) for a, b in zip(runs[1], runs[2])]
    return {"convert criteo text, 1 worker": one, "convert criteo text, 2 workers": two}


def first_batch(spec: DataSpec) -> dict[str, float]:
    """Open the source for training from nothing in a new process, converting in the
    background: seconds to the first batch of 4,096 rows, and to the end of the conversion."""
    r = _converted_in_a_process(spec, 2, first_batch=True)
    return {"first_batch_s": r["first_batch_s"], "converted_s": r["seconds"], "rows": r["rows"]}


def run_conversion(tmp: Path, *, rows: int | None, size: int | None, repeat: int, gz: bool) -> dict[str, dict]:
    """The conversion benchmark (see the module docstring)."""
    files, _ = write_criteo_days(tmp / "text", rows=rows, size=size)
    text_bytes = sum(f.stat().st_size for f in files)
    spec = DataSpec(format="criteo", path=str(tmp / "text" / "day_*.tsv"), cache_dir=str(tmp / "cache"))
    out = paired_conversions(spec, repeat)
    first = first_batch(spec)
    out["first batch while converting (2 workers)"] = {
        "rows": first["rows"], "seconds": first["first_batch_s"], "rows_per_s": float("nan"),
        "rows_per_cpu_s": float("nan"), "rows_per_s_runs": [], "converted_s": first["converted_s"],
    }  # fmt: skip
    shutil.rmtree(tmp / "cache", ignore_errors=True)
    gzipped = files if gz else files[:1]  # at --size, one day: compressing is slow
    for f in gzipped:
        with f.open("rb") as src, gzip.open(f.with_suffix(".tsv.gz"), "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        f.unlink()
    pattern = "day_*.tsv.gz" if gz else "day_0.tsv.gz"
    gz_spec = DataSpec(format="criteo", path=str(tmp / "text" / pattern), cache_dir=str(tmp / "cache"))
    out[f"convert criteo text.gz{'' if gz else ' (day 0)'}, 1 worker"] = timed_conversion(gz_spec, 1, repeat)
    shutil.rmtree(tmp / "cache", ignore_errors=True)
    shutil.rmtree(tmp / "text", ignore_errors=True)
    for r in out.values():
        r["text_bytes"] = text_bytes
    return out


def run(size: str, repeat: int, tmp: Path) -> dict[str, dict[str, float | list[float]]]:
    copies, epochs, synthetic_rows, _ = SIZES[size]
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
    out["convert tsv to preprocessed"] = timed(lambda: convert(spec, _fresh(tmp / "pre"), progress=False).rows, repeat)
    out["convert npy days"] = timed(lambda: convert(npy, _fresh(tmp / "pre-npy"), progress=False).rows, repeat)
    out["convert parquet"] = timed(lambda: convert(parquet, _fresh(tmp / "pre-pq"), progress=False).rows, repeat)
    out["open npy days in place, read all"] = timed(lambda: _read_all(open_dataset(npy)), repeat)
    out["open parquet in place, read all"] = timed(lambda: _read_all(open_dataset(parquet)), repeat)
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


def _fresh(path: Path) -> Path:
    """`path` emptied: a conversion finds nothing to resume (each run converts everything)."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def _read_all(data: object) -> int:
    n = 0
    for b in data.train_batches(4096):  # type: ignore[attr-defined]
        n += len(b.labels)
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    parser.add_argument("--repeat", type=int, help="runs per stage; the median is shown (default 3; 1 with --smoke)")
    parser.add_argument("--size", type=parse_size, help="bytes of synthetic Criteo text to convert (10GB, 500MB); "
                        "its conversions run once each, the gzipped one on its first day")
    parser.add_argument("--tmp", type=Path, help="where to write the data (default: the system's temporary folder)")
    add_result_options(parser, NAME, "the 8,000-row sample once, one run per stage")
    args = parser.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    repeat = args.repeat or (1 if args.smoke else 3)
    with tempfile.TemporaryDirectory(prefix="bench-data-", dir=args.tmp) as tmp:
        results = run(size, repeat, Path(tmp))
        text_rows = SIZES[size][3] if args.size is None else None
        conversion = run_conversion(Path(tmp) / "conversion", rows=text_rows, size=args.size,
                                    repeat=(args.repeat or 1) if args.size else repeat, gz=args.size is None)  # fmt: skip
    results |= conversion
    print(f"{'stage':<44}{'rows':>11}{'seconds':>9}{'rows/s':>13}{'rows/cpu-s':>13}{'spread':>14}"
          f"   ({os.cpu_count()} cores, median of {repeat})")  # fmt: skip
    for name, r in results.items():
        print(f"{name:<44}{r['rows']:>11,}{r['seconds']:>9.2f}{r['rows_per_s']:>13,.0f}"
              f"{r['rows_per_cpu_s']:>13,.0f}{spread(r):>14}{_mb(r):>10}")  # fmt: skip
    figures = conversion_figures(conversion)
    for key, value in figures.items():
        print(f"{key}: " + (" to ".join(f"{v:,.3f}" for v in value) if isinstance(value, list) else f"{value:,.3f}"))
    copies, epochs, synthetic_rows, text_rows = SIZES[size]
    config = config_of(args, repeat=repeat, sample_copies=copies, read_epochs=epochs, synthetic_rows=synthetic_rows,
                       text_bytes=next(iter(conversion.values()))["text_bytes"])  # fmt: skip
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"stages": results, **figures}, headline=headline(results), smoke=args.smoke)
    return 0


def conversion_figures(conversion: dict[str, dict]) -> dict[str, float | list[float]]:
    """The figures issue #32 asks of the conversion: rows per CPU-second of one worker, the
    speed-up of two, the peak RSS of all, the time to the first batch."""
    one, two = conversion["convert criteo text, 1 worker"], conversion["convert criteo text, 2 workers"]
    return {
        "convert_rows_per_cpu_s": one["rows_per_cpu_s"], "convert_rows_per_cpu_s_2_workers": two["rows_per_cpu_s"],
        "convert_speedup_2_workers": statistics.median(two["speedups"]),
        "convert_speedup_2_workers_range": [min(two["speedups"]), max(two["speedups"])],
        "convert_cores_busy": one["cores_busy"], "convert_cores_busy_2_workers": two["cores_busy"],
        "peak_rss_mb": max(r.get("peak_rss_mb", 0.0) for r in conversion.values()),
        "peak_pss_mb": max(r.get("peak_pss_mb", 0.0) for r in conversion.values()),
        "first_batch_s": conversion["first batch while converting (2 workers)"]["seconds"],
        "converted_bytes_on_disk": float(one["disk_bytes"]), "text_bytes": float(one["text_bytes"]),
    }  # fmt: skip


def _mb(r: dict) -> str:
    return f"{r['peak_rss_mb']:,.0f} MB" if "peak_rss_mb" in r else ""


def spread(r: dict) -> str:
    """The lowest and highest rows/s of a stage's runs, relative to their median."""
    runs = r["rows_per_s_runs"]
    if len(runs) < 2:
        return "—"
    return f"-{1 - min(runs) / r['rows_per_s']:.0%}/+{max(runs) / r['rows_per_s'] - 1:.0%}"


def headline(results: dict[str, dict]) -> Table:
    columns = ("stage", "rows", "seconds", "rows/s", "rows/CPU-s", "spread", "cores busy", "peak RSS MB",
               "on disk MB")
    return Table(columns, tuple(
        (name, r["rows"], r["seconds"], r["rows_per_s"], r["rows_per_cpu_s"], spread(r), r.get("cores_busy"),
         r.get("peak_rss_mb"), r["disk_bytes"] / 2**20 if "disk_bytes" in r else None)
        for name, r in results.items()))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
