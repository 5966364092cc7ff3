"""Conversion of a source (raw click logs; npy days or parquet that cannot be read in place)
into the preprocessed format: in `[data] workers` processes, resumable, with bounded memory.

The source is cut into pieces (`plan_units`): byte ranges of text files cut at line ends (a
``.gz`` file whole), row ranges of npy days, row-group ranges of parquet files. Each piece
becomes one part of the output (``parts/<file>/<piece>/``), so the result does not depend
on how many workers wrote it: one process or sixteen give the same bytes, in the same
files. Dictionary hashing counts each piece's values first (``counts/``, one pass), merges
them per table into the dictionaries, then maps (a second pass), with the same result as
counting in one process.

A conversion's folder holds ``plan.json`` (what it converts: settings, files, pieces),
then the pieces' outputs, then ``manifest.json``, written last: only that makes it
complete. A conversion stopped at any point (Ctrl-C, a kill, a bad line) resumes where it
stopped: complete parts whose file is unchanged are checked (sizes) and kept, the others
are done again; partial ones (temporary names) are removed.

Bad data is reported as one process reading in order would: the first bad line (or row)
of the source, with its file and line, whichever worker found it.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice, pairwise, takewhile
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tqdm import tqdm

from common.data.chunks import MalformedData, Reader
from common.data.files import fingerprint, sampled_checksum
from common.data.mapping import Counter, RowMapper, save_vocabulary, vocabulary_file
from common.data.npy import PIECE_ROWS, NpyDaysReader, NpyPiece, day_files, day_rows
from common.data.parquet import ParquetReader, check_schema, parquet_files
from common.data.preprocessed import (
    MANIFEST,
    Manifest,
    Part,
    PartWriter,
    check_part,
    read_part_info,
    remove_stale_temps,
    sparse_dtype,
    write_json_atomically,
)  # fmt: skip
from common.data.raw import (
    DENSE_ROUNDING,
    PIECE_BYTES,
    Piece,
    PieceReader,
    check_not_empty,
    count_lines,
    header_lines,
    raw_format,
    source_files,
    split_file,
)  # fmt: skip
from common.data.spec import DataSpec
from common.errors import ConfigError

log = logging.getLogger(__name__)
PLAN = "plan.json"
PLAN_VERSION = 1
MIN_PIECE_BYTES = 16 << 20
PARQUET_PIECE_ROWS = 1 << 22
# Work below this many source bytes is done in this process: starting a worker (imports,
# numba's cache) costs about a second, more than converting this much.
PARALLEL_BYTES = 64 << 20  # row groups are grouped into pieces of about this many rows
Kind = Literal["lines", "count", "convert"]


def conversion_config(spec: DataSpec) -> dict[str, Any]:
    """The settings that decide a conversion's output; a cache is reused only if they match.
    (`workers` is not one: any number of workers writes the same bytes.)"""
    config: dict[str, Any] = {
        "format": spec.format, "hashing": spec.hashing, "min_frequency": spec.min_frequency,
        "table_sizes": list(spec.table_sizes), "on_error": spec.on_error,
    }  # fmt: skip
    if spec.format == "criteo-npy":
        config["sparse_path"] = spec.sparse_path  # where the sparse ids come from decides them
    if spec.format == "parquet":
        config |= {"label_column": spec.label_column, "dense_columns": list(spec.dense_columns),
                   "sparse_columns": list(spec.sparse_columns), "dense_transform": spec.dense_transform}  # fmt: skip
    if spec.format in ("criteo", "criteo-terabyte") or spec.dense_transform == "log1p":
        config["dense_rounding"] = DENSE_ROUNDING  # caches whose log1p rounded otherwise are not reused
    return config


def open_reader(spec: DataSpec, *, on_bytes: Callable[[int], None] = lambda n: None) -> Reader:
    """The reader of a whole source, in one process; opening checks what can be checked
    before reading rows (npy headers and shapes, parquet schemas)."""
    if spec.format == "criteo-npy":
        return NpyDaysReader(spec, on_bytes=on_bytes)
    if spec.format == "parquet":
        return ParquetReader(spec, on_bytes=on_bytes)
    from common.data.raw import RawReader

    return RawReader(spec, on_bytes=on_bytes)


def source_paths(spec: DataSpec) -> list[Path]:
    """The files a source is read from, in order (without reading them)."""
    return [p for unit in source_units(spec) for p in unit.paths]


def table_names(spec: DataSpec) -> tuple[str, ...] | None:
    """The tables' names of a source format (None for synthetic or preprocessed data)."""
    if spec.format == "parquet":
        return spec.sparse_columns
    if spec.format == "criteo-npy":
        return NpyDaysReader.tables
    return raw_format(spec).tables if spec.is_raw else None


def num_dense_of(spec: DataSpec) -> int:
    if spec.format == "parquet":
        return len(spec.dense_columns)
    return NpyDaysReader.num_dense if spec.format == "criteo-npy" else raw_format(spec).num_dense


def source_fingerprint(spec: DataSpec) -> list[dict[str, Any]]:
    """Name, size and mtime of every source file: a cheap check that a cache is still current."""
    return fingerprint(source_paths(spec))


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One source file (raw or parquet) or npy day (its three files): what a conversion
    keeps or does again as a whole, and the parts of which a run may read once written."""

    name: str
    paths: tuple[Path, ...]

    @property
    def key(self) -> str:
        """Its folder under ``parts/``: the name, and a hash of where it lies (two files of
        one name in two folders are two units)."""
        where = hashlib.blake2b("\0".join(map(str, self.paths)).encode(), digest_size=4).hexdigest()
        return f"{self.name}-{where}"


@dataclass(frozen=True, kw_only=True)
class Task:
    """One piece of a unit, for one pass: what a worker is sent (it pickles small)."""

    spec: DataSpec
    out: Path  # the conversion's folder
    unit: Unit
    index: int  # the piece, in its unit
    start: int  # bytes (text), rows (npy), row groups (parquet)
    stop: int
    weight: int  # source bytes it stands for (progress)
    sizes: tuple[int, ...]  # the tables' sizes (empty until dictionaries exist)

    @property
    def name(self) -> str:
        return f"{self.unit.key}/{self.index:05d}"

    @property
    def part(self) -> Path:
        return self.out / "parts" / self.name

    @property
    def counts(self) -> Path:
        return self.out / "counts" / f"{self.name}.npz"

    @property
    def range(self) -> list[int]:
        return [self.start, self.stop]


@dataclass(frozen=True, kw_only=True)
class Done:
    """What a worker did with a task: the piece's rows, lines and bad lines dropped."""

    rows: int
    lines: int
    skipped: int = 0
    cpu_s: float = 0.0  # the worker's CPU time on it


@dataclass(frozen=True, kw_only=True)
class Failed:
    """Why a task could not be done: bad data (file, line or row, why) or a bad setting.
    Errors travel back as values: exceptions with their own constructors do not unpickle."""

    path: str | None = None
    line: int | None = None
    row: int | None = None
    why: str
    field: str | None = None  # a ConfigError's

    def error(self) -> Exception:
        if self.field is not None:
            return ConfigError(self.field, self.why)
        return MalformedData(Path(str(self.path)), self.line, self.why, row=self.row)


def source_units(spec: DataSpec) -> list[Unit]:
    """The units of a source, in order (files are listed, not read)."""
    if spec.format == "criteo-npy":
        if spec.path is None or not isinstance(spec.path, str):
            raise ConfigError("data.path", "criteo-npy reads one folder of day_N_*.npy files")
        folder = Path(spec.path)
        days = day_files(folder, Path(spec.sparse_path) if spec.sparse_path else folder)
        return [Unit(name=f.name.rsplit("_", 1)[0], paths=(f, day["dense"], day["sparse"]))
                for day in days for f in (day["labels"],)]  # fmt: skip
    files = parquet_files(spec) if spec.format == "parquet" else source_files(spec)
    return [Unit(name=p.name, paths=(p,)) for p in files]


def piece_size(total: int) -> int:
    """Bytes of text per piece for a source of `total` bytes: `PIECE_BYTES`, or less for a
    small source, so that its pieces keep many workers busy to the end. A function of the
    source alone: the pieces, and so the output's files, never depend on the workers."""
    return min(PIECE_BYTES, max(MIN_PIECE_BYTES, total // 64))


def unit_pieces(spec: DataSpec, unit: Unit, piece_bytes: int) -> list[tuple[int, int, int]]:
    """(start, stop, weight in bytes) of each piece of a unit; opening checks what can be
    checked without reading rows (an empty text file, npy headers, parquet schemas)."""
    size = sum(p.stat().st_size for p in unit.paths)
    if spec.format == "criteo-npy":
        files = dict(zip(("labels", "dense", "sparse"), unit.paths, strict=True))
        NpyPiece(spec, files, 0, 0)  # checks the day's three files agree
        rows = day_rows(files)
        cuts = [*range(0, rows, PIECE_ROWS), rows] if rows else [0, 0]
        return [(a, b, size * (b - a) // max(rows, 1)) for a, b in pairwise(cuts)]
    if spec.format == "parquet":
        check_schema(unit.paths[0], spec)
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(unit.paths[0]).metadata
        groups, rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)], meta.num_rows
        cuts, acc = [0], 0
        for g, n in enumerate(groups):
            acc += n
            if acc >= PARQUET_PIECE_ROWS and g + 1 < len(groups):
                cuts.append(g + 1)
                acc = 0
        cuts.append(len(groups))
        done = np.cumsum([0, *groups])
        return [(a, b, size * int(done[b] - done[a]) // max(rows, 1)) for a, b in pairwise(cuts)]
    check_not_empty(unit.paths[0])
    header_lines(raw_format(spec), unit.paths[0])  # a bad header fails before any long pass
    return [(p.start, p.stop, p.stop - p.start) for p in split_file(unit.paths[0], piece_bytes)]


def piece_reader(task: Task, on_bytes: Callable[[int], None]) -> Any:
    """A reader of one task's piece: `chunks()`, then `rows`, `skipped` (and `lines`)."""
    spec = task.spec
    if spec.format == "criteo-npy":
        files = dict(zip(("labels", "dense", "sparse"), task.unit.paths, strict=True))
        return NpyPiece(spec, files, task.start, task.stop, on_bytes=on_bytes)
    if spec.format == "parquet":
        return _ParquetPiece(spec, task.unit.paths[0], range(task.start, task.stop), on_bytes)
    path = task.unit.paths[0]
    fmt = raw_format(spec)
    piece = Piece(path=path, index=task.index, start=task.start, stop=task.stop)
    header = header_lines(fmt, path) if task.index == 0 else 0
    return PieceReader(fmt, piece, on_error=spec.on_error, header=header, on_bytes=on_bytes)


class _ParquetPiece:
    def __init__(self, spec: DataSpec, file: Path, groups: range, on_bytes: Callable[[int], None]) -> None:
        self.reader = ParquetReader(spec, files=[file], on_bytes=on_bytes)
        self.file, self.groups = file, groups

    def chunks(self) -> Iterator[Any]:
        return self.reader.file_chunks(self.file, self.groups)

    @property
    def rows(self) -> int:
        return self.reader.rows

    @property
    def skipped(self) -> int:
        return self.reader.skipped


# -- what a worker does with a task ---------------------------------------------------------

_progress: Any = None  # a worker process's queue to its parent (set by `_start_worker`)


def _start_worker(progress: Any) -> None:
    global _progress
    _progress = progress


def _report(n_bytes: int, rows: int) -> None:
    if _progress is not None:
        _progress.put((n_bytes, rows))


def work(kind: Kind, task: Task, report: Callable[[int, int], None] = _report) -> Done | Failed:
    """Do one task: count its piece's lines, count its values (dictionary), or convert it
    into its part. Bad data comes back as `Failed`."""
    started = time.process_time()
    try:
        do = _count_lines if kind == "lines" else _count_values if kind == "count" else _convert_piece
        return dataclasses.replace(do(task, report), cpu_s=time.process_time() - started)
    except MalformedData as exc:
        return Failed(path=str(exc.path), line=exc.line, row=exc.row, why=exc.why)
    except ConfigError as exc:
        return Failed(field=exc.field, why=exc.message.removeprefix(f"{exc.field}: "))


def _count_lines(task: Task, report: Callable[[int, int], None]) -> Done:
    piece = Piece(path=task.unit.paths[0], index=task.index, start=task.start, stop=task.stop)
    header = header_lines(raw_format(task.spec), piece.path) if task.index == 0 else 0
    lines = count_lines(piece, header)
    report(task.weight, 0)
    return Done(rows=lines, lines=lines)


def _count_values(task: Task, report: Callable[[int, int], None]) -> Done:
    counters = [Counter() for _ in table_names(task.spec) or ()]
    reader = piece_reader(task, lambda n: report(n, 0))
    for chunk in reader.chunks():
        for t, counter in enumerate(counters):
            counter.add(chunk.ids[:, t])
        report(0, len(chunk))
    arrays: dict[str, np.ndarray] = {}
    for t, counter in enumerate(counters):
        counter.flush()
        arrays[f"values_{t}"], arrays[f"counts_{t}"] = counter.values, counter.counts
    task.counts.parent.mkdir(parents=True, exist_ok=True)
    tmp = task.counts.with_name(f".{task.counts.name}.tmp-{os.getpid()}.npz")
    np.savez(tmp, rows=reader.rows, skipped=reader.skipped, tables=len(counters), **arrays)
    os.replace(tmp, task.counts)
    return Done(rows=reader.rows, lines=reader.rows + reader.skipped, skipped=reader.skipped)


def _convert_piece(task: Task, report: Callable[[int, int], None]) -> Done:
    spec = task.spec
    if spec.hashing == "dictionary":
        mapper = RowMapper.load_dictionary(task.out, len(task.sizes), spec.table_sizes)
    else:
        mapper = RowMapper(sizes=task.sizes, direct_tables=_direct_tables(spec), ids_are_rows=spec.hashing == "none")
    dtype = sparse_dtype(task.sizes)
    reader = piece_reader(task, lambda n: report(n, 0))
    with PartWriter(final=task.part, num_dense=num_dense_of(spec), table_sizes=task.sizes) as writer:
        for chunk in reader.chunks():
            writer.arrays.append(chunk.labels, chunk.dense, mapper.rows_as(chunk.ids, dtype))
            report(0, len(chunk))
        done = Done(rows=reader.rows, lines=reader.rows + reader.skipped, skipped=reader.skipped)
        writer.commit({"range": task.range, "lines": done.lines, "skipped": done.skipped})
    return done


def _direct_tables(spec: DataSpec) -> tuple[int, ...]:
    return raw_format(spec).direct_tables if spec.is_raw else ()


def merge_table(out: Path, names: Sequence[str], table: int, min_frequency: int, cap: int | None) -> int:
    """Merge table `table`'s counts of every piece into its dictionary (`vocab_<t>.npy`);
    returns the values it holds. Exact counts, so the same dictionary as one pass."""
    counter = Counter()
    values, counts = [], []
    for name in names:
        with np.load(out / "counts" / f"{name}.npz") as piece:
            if int(piece["tables"]) > table:
                values.append(piece[f"values_{table}"])
                counts.append(piece[f"counts_{table}"])
    if values:
        counter.merge(np.concatenate(values), np.concatenate(counts))
    vocab = counter.vocabulary(min_frequency, cap)
    save_vocabulary(out, table, vocab)
    return len(vocab.values)


# -- the parent: plan, passes, manifest ------------------------------------------------------


def worker_context() -> multiprocessing.context.BaseContext:
    """How workers start: forked from a server process (started once, on first use) that
    has imported the converter and loaded its kernels, so a worker starts in milliseconds,
    sharing their memory. Not forked from this process: it may run threads (a server,
    tqdm's monitor) that a fork would copy mid-operation."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["common.data.kernels", "common.data.convert"])
    return context


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Conversion:
    """The conversion of `spec`'s source into the folder `out` (see the module docstring).

    `run` does it all, or what is left of it. With `ready`, it is called once the first
    unit is converted and the rows of every piece are known (`rows.json`): a reader may
    then read the parts written so far (`ConvertingDataset`) while the rest convert.
    """

    def __init__(self, spec: DataSpec, out: Path, *, workers: int | None = None, progress: bool = False) -> None:
        self.spec, self.out, self.progress = spec, out, progress
        self.workers = workers or spec.workers or available_cores()
        self.units = source_units(spec)
        self.num_dense = num_dense_of(spec)
        names = table_names(spec) or ()
        if spec.table_sizes and len(spec.table_sizes) != len(names):
            raise ConfigError("data.table_sizes", f"{spec.format} has {len(names)} tables, "
                              f"got {len(spec.table_sizes)} sizes")  # fmt: skip
        self.num_tables = len(names)
        self._stop = False
        self.worker_cpu_s = 0.0  # CPU time of the worker processes (not of this one) on their tasks
        self._ready = False  # readers have started: the bar gives way to theirs (log lines only)

    def stop(self) -> None:
        """Ask a running `run` (in another thread) to stop after the pieces in hand."""
        self._stop = True

    def run(self, ready: Callable[[], None] | None = None) -> Manifest:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / MANIFEST).unlink(missing_ok=True)  # first: a stale manifest must not outlive this
        (self.out / FAILED).unlink(missing_ok=True)
        try:
            return self._run(ready)
        except (MalformedData, ConfigError) as exc:
            # for the readers of a conversion that runs on while they train (other processes)
            body = {"path": str(exc.path), "line": exc.line, "row": exc.row, "why": exc.why} if isinstance(
                exc, MalformedData) else {"field": exc.field, "why": exc.message.removeprefix(f"{exc.field}: ")}
            write_json_atomically(self.out / FAILED, body)
            raise

    def _run(self, ready: Callable[[], None] | None) -> Manifest:
        out = self.out
        plan = self._plan()
        tasks = [self._task(u, i, piece)
                 for u, unit in enumerate(plan["units"]) for i, piece in enumerate(unit["pieces"])]  # fmt: skip
        sizes, extra, readable = self.spec.table_sizes, [], False
        if self.spec.hashing == "dictionary":
            counted = self._pass([("count", t) for t in tasks], self._counted)
            sizes = self._dictionaries(tasks)
            extra = [vocabulary_file(t) for t in range(self.num_tables)]
            write_json_atomically(out / ROWS, [d.rows for d in counted])
            readable = True  # every piece's rows are known: readers may start once the first is in
        tasks = [dataclasses.replace(t, sizes=tuple(sizes)) for t in tasks]
        first = [t for t in tasks if t.unit == tasks[0].unit] if tasks else []
        ready = None if ready is None else self._hide_bar_then(ready)
        if ready is not None and not readable and self.spec.on_error == "fail" and self.spec.is_raw:
            # Convert the first file while counting the lines of the others (in fail mode a
            # line is a row): then the length is exact and the first file readable.
            jobs: list[tuple[Kind, Task]] = [("convert", t) for t in first]
            ahead = self._pass(jobs + [("lines", t) for t in tasks[len(first):]], self._converted)
            write_json_atomically(out / ROWS, [d.rows for d in ahead])
            ready()
            ready = None
        on_done = None if ready is None or not readable else _when_prefix_done(len(first), ready)
        results = self._pass([("convert", t) for t in tasks], self._converted, on_done=on_done)
        parts = tuple(Part(name=f"parts/{t.name}", rows=r.rows) for t, r in zip(tasks, results, strict=True))
        manifest = Manifest(
            rows=sum(p.rows for p in parts), num_dense=self.num_dense, table_sizes=tuple(sizes),
            config=conversion_config(self.spec), extra_files=tuple(extra), parts=parts,
            source={"files": plan["files"], "checksum": plan["checksum"],
                    "skipped_lines": sum(r.skipped for r in results)},
        )  # fmt: skip
        write_json_atomically(out / MANIFEST, manifest.to_json())
        if ready is not None and on_done is None:
            ready()  # rows known only now (skip mode): readers start at the end
        if manifest.source["skipped_lines"]:
            log.warning("skipped %d malformed line(s) in %s", manifest.source["skipped_lines"], self.spec.path)
        log.info("converted %d rows into %s", manifest.rows, out)
        return manifest

    def _hide_bar_then(self, ready: Callable[[], None]) -> Callable[[], None]:
        def hide_then_ready() -> None:
            self._ready = True
            log.info("%s: the first file is converted; the rest converts while it is read", self.out)
            ready()

        return hide_then_ready

    def _task(self, u: int, i: int, piece: list[int]) -> Task:
        return Task(spec=self.spec, out=self.out, unit=self.units[u], index=i, start=piece[0], stop=piece[1],
                    weight=piece[2], sizes=self.spec.table_sizes)  # fmt: skip

    def _plan(self) -> dict[str, Any]:
        """This conversion's plan, reusing the pieces (and so the parts) of every unit whose
        files are unchanged since `plan.json` was written; what it no longer needs goes."""
        out = self.out
        old = read_json(out / PLAN)
        config = conversion_config(self.spec)
        files = fingerprint([p for u in self.units for p in u.paths])
        if old is None or old.get("version") != PLAN_VERSION or old.get("config") != config:
            old = {"units": []}
            for folder in ("parts", "counts"):
                shutil.rmtree(out / folder, ignore_errors=True)
        kept = {u["key"]: u for u in old["units"]}
        piece_bytes = piece_size(sum(f["bytes"] for f in files))
        units = []
        for unit in self.units:
            prints = fingerprint(unit.paths)
            same = unit.key in kept and kept[unit.key]["files"] == prints
            pieces = kept[unit.key]["pieces"] if same else [list(p) for p in unit_pieces(self.spec, unit, piece_bytes)]
            units.append({"key": unit.key, "files": prints, "pieces": pieces})
        changed = [u["key"] for u in units if kept.get(u["key"], {}).get("files") != u["files"]]
        every_unit = [u["key"] for u in units] == [u["key"] for u in old["units"]]
        if self.spec.hashing == "dictionary" and (changed or not every_unit):
            shutil.rmtree(out / "counts", ignore_errors=True)  # every count feeds every dictionary
            shutil.rmtree(out / "parts", ignore_errors=True)
        for key in set(kept) - {u["key"] for u in units if u["key"] not in changed}:
            shutil.rmtree(out / "parts" / key, ignore_errors=True)
            shutil.rmtree(out / "counts" / key, ignore_errors=True)
        checksum = old.get("checksum") if old.get("files") == files else None
        plan = {"version": PLAN_VERSION, "config": config, "files": files, "units": units,
                "checksum": checksum or sampled_checksum([p for u in self.units for p in u.paths])}  # fmt: skip
        write_json_atomically(out / PLAN, plan)
        (out / ROWS).unlink(missing_ok=True)
        return plan

    def _converted(self, kind: Kind, task: Task) -> Done | None:
        """`task`'s part, if complete and current (whatever `kind` asks: a converted piece's
        lines are known too): its part.json names the same piece, and its arrays have the
        sizes its rows need."""
        info = read_part_info(task.part)
        if info is None or info.get("range") != task.range:
            return None
        if check_part(task.part, int(info["rows"]), self.num_dense, task.sizes, self.out) is not None:
            return None
        return Done(rows=int(info["rows"]), lines=int(info["lines"]), skipped=int(info["skipped"]))

    def _counted(self, kind: Kind, task: Task) -> Done | None:
        """`task`'s values, if counted already (dictionary hashing)."""
        if not task.counts.is_file():
            return None
        with np.load(task.counts) as piece:
            rows, skipped = int(piece["rows"]), int(piece["skipped"])
        return Done(rows=rows, lines=rows + skipped, skipped=skipped)

    def _dictionaries(self, tasks: list[Task]) -> tuple[int, ...]:
        caps = self.spec.table_sizes
        names = [t.name for t in tasks]
        jobs = [(self.out, names, t, self.spec.min_frequency, caps[t] if caps else None)
                for t in range(self.num_tables)]  # fmt: skip
        if self._pool_size(len(jobs)) == 1 or sum(t.weight for t in tasks) < PARALLEL_BYTES:
            counts = [merge_table(*job) for job in jobs]
        else:
            with self._pool(len(jobs), None) as pool:
                counts = list(pool.map(merge_table, *zip(*jobs, strict=True)))
        return caps or tuple(2 + n for n in counts)

    def _pool_size(self, tasks: int) -> int:
        return max(1, min(self.workers, tasks))

    @contextmanager
    def _pool(self, tasks: int, progress: Any) -> Iterator[ProcessPoolExecutor]:
        pool = ProcessPoolExecutor(self._pool_size(tasks), mp_context=worker_context(), initializer=_start_worker,
                                   initargs=(progress,))  # fmt: skip
        try:
            yield pool
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _pass(
        self, jobs: list[tuple[Kind, Task]], done: Callable[[Kind, Task], Done | None], *,
        on_done: Callable[[int], None] | None = None,
    ) -> list[Done]:  # fmt: skip
        """Do every job not `done` already, `workers` at a time; their results in job order.
        The first bad piece in job order fails the pass (MalformedData). `on_done` is told
        how many jobs from the first are done, as that grows."""
        results: list[Done | None] = [done(kind, task) for kind, task in jobs]
        todo = [i for i, r in enumerate(results) if r is None]
        for i in todo:
            if jobs[i][1].part.parent.is_dir():
                remove_stale_temps(jobs[i][1].part)  # a part a killed worker was writing
        tasks = [task for _, task in jobs]
        with _bar(jobs[0][0] if jobs else "convert", tasks, results, self.progress and not self._ready,
                  lambda: self._ready) as bar:  # fmt: skip
            if self._pool_size(len(todo)) == 1 or sum(tasks[i].weight for i in todo) < PARALLEL_BYTES:
                for i in todo:
                    if self._stop:
                        raise Stopped(self.out)
                    results[i] = _ok(work(*jobs[i], bar.report))
                    if on_done is not None:
                        on_done(_prefix(results))
            else:
                self._run_parallel(jobs, todo, results, bar, on_done)
        if on_done is not None:
            on_done(len(results))
        return [r for r in results if r is not None]

    def _run_parallel(
        self, jobs: list[tuple[Kind, Task]], todo: list[int], results: list[Done | None], bar: _Bar,
        on_done: Callable[[int], None] | None,
    ) -> None:  # fmt: skip
        progress = worker_context().SimpleQueue()
        failure: tuple[int, Failed] | None = None
        with self._pool(len(todo), progress) as pool, ThreadPoolExecutor(1) as this_process:
            # The pool's first submit waits for its workers to start (about a second: an
            # interpreter, numba's kernels): meanwhile the last job runs here, in a thread
            # (the kernels release the GIL) that reports as the workers do.
            own = this_process.submit(work, *jobs[todo[-1]], lambda n_bytes, rows: progress.put((n_bytes, rows)))
            futures: dict[Future[Done | Failed], int] = {pool.submit(work, *jobs[i]): i for i in todo[:-1]}
            futures[own] = todo[-1]
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                while not progress.empty():
                    bar.report(*progress.get())
                for future in finished:
                    i = futures[future]
                    try:
                        result = future.result()
                    except BrokenProcessPool:
                        raise RuntimeError(f"a conversion worker died (out of memory?); run again to resume "
                                           f"{self.out}") from None  # fmt: skip
                    if isinstance(result, Failed):
                        if failure is None or i < failure[0]:
                            failure = (i, result)  # later pieces need not run: the first bad one wins
                            for f, j in futures.items():
                                if j > i:
                                    f.cancel()
                    else:
                        results[i] = result
                        self.worker_cpu_s += 0.0 if future is own else result.cpu_s
                if on_done is not None and failure is None:
                    on_done(_prefix(results))
                if self._stop and failure is None:
                    for f in pending:
                        f.cancel()
                    failure = (len(jobs), Failed(why=""))
                pending = {f for f in pending if not f.cancelled()}
        if failure is not None:
            if failure[0] == len(jobs):
                raise Stopped(self.out)
            raise failure[1].error()


ROWS = "rows.json"  # rows of every piece, once known: readers may start before the end
FAILED = "failed.json"  # the error that stopped the conversion


def failure(out: Path) -> Exception | None:
    """The error that stopped the conversion in `out` (from another process), if any."""
    body = read_json(out / FAILED)
    return None if body is None else Failed(**body).error()


class Stopped(Exception):
    """A conversion stopped on request (`Conversion.stop`) before it was complete."""

    def __init__(self, out: Path) -> None:
        super().__init__(f"the conversion into {out} stopped before it was complete; it resumes when run again")


def _ok(result: Done | Failed) -> Done:
    if isinstance(result, Failed):
        raise result.error()
    return result


def _prefix(results: Sequence[Done | None]) -> int:
    """How many results from the first are in."""
    return sum(1 for _ in takewhile(lambda r: r is not None, results))


def _when_prefix_done(first: int, ready: Callable[[], None]) -> Callable[[int], None]:
    called = False

    def on_done(prefix: int) -> None:
        nonlocal called
        if prefix >= first and not called:
            called = True
            ready()

    return on_done


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None (missing, unreadable, not an object)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


class _Bar:
    """A pass's progress: source bytes done of bytes to do, rows/s and an ETA (tqdm);
    cleared once `hidden` says so (another bar takes the terminal)."""

    def __init__(self, bar: tqdm, hidden: Callable[[], bool]) -> None:
        self.bar, self.hidden, self.rows, self.started = bar, hidden, 0, time.perf_counter()
        self._drawn = self.started

    def report(self, n_bytes: int, rows: int) -> None:
        self.rows += rows
        if not self.bar.disable and self.hidden():
            self.bar.clear()
            self.bar.disable = True
        self.bar.update(n_bytes)
        now = time.perf_counter()
        if now - self._drawn > 0.5:
            self._drawn = now
            self.bar.set_postfix_str(f"{self.rows / max(now - self.started, 1e-9):,.0f} rows/s", refresh=False)


@contextmanager
def _bar(
    kind: Kind, tasks: list[Task], results: list[Done | None], progress: bool, hidden: Callable[[], bool]
) -> Iterator[_Bar]:
    """A bar over the source's bytes that ends where bad data stopped the pass.

    Readers count bytes as they take them in, a block (8 MiB for text) ahead of the rows
    they have checked, so a small file's bar would read 100 % before its first error.
    """
    done = sum(t.weight for t, r in zip(tasks, results, strict=True) if r is not None)
    total = sum(t.weight for t in tasks)
    with tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=kind, disable=not progress) as bar:
        try:
            yield _Bar(bar, hidden)
        except MalformedData as exc:
            bar.n = _bytes_before([p for t in tasks if t.index == 0 for p in t.unit.paths], exc)
            raise


def _bytes_before(files: list[Path], error: MalformedData) -> int:
    """Bytes of the source files before the bad line; before its file where no line is
    known (a bad row of an array or parquet file, a bad file). In a .gz file, compressed
    bytes as far as the decompressor has read."""
    done = sum(p.stat().st_size for p in takewhile(lambda p: p != error.path, files))
    if error.line is None:
        return done
    with error.path.open("rb") as raw:
        lines = gzip.GzipFile(fileobj=raw) if error.path.suffix == ".gz" else raw
        deque(islice(lines, error.line - 1), maxlen=0)  # skip them at C speed
        return done + raw.tell()


def convert(spec: DataSpec, out: Path, *, progress: bool = True, workers: int | None = None) -> Manifest:
    """Convert the source of `spec` into a preprocessed directory at `out` (or finish a
    conversion stopped there). Raises MalformedData on the first bad line or row (unless
    ``on_error="skip"``) or file; what was converted before it is kept for the next run,
    and `out` has no manifest, so nothing takes it for complete."""
    return Conversion(spec, out, workers=workers, progress=progress).run()
