"""A live source: a watched folder whose parts arrive while the run trains
(docs/design.md#online-training).

``[data] watch = true`` makes `path` (a glob pattern, or a folder: its visible files) a
stream. A part is taken once it is complete:

* ``ready = "renamed"`` (the default): every file the pattern matches is complete. Writers
  write elsewhere (or under a name the pattern does not match, a hidden one) and rename
  the finished file into place, which is atomic.
* ``ready = "success"``: a file is complete once a ``_SUCCESS`` file is beside it, as
  Hadoop and Spark mark a finished output folder.

Files whose names start with ``.`` or ``_`` are never parts. Parts are taken in natural
order (``part-2`` before ``part-10``, over the path below the pattern's first plain
folder) as they become complete; one that completes after a part that sorts after it is
taken when it completes, with a warning: the stream is the order parts were taken in.

That order is the stream's one fact that is not in the files: `StreamLog` appends each
part to ``parts.jsonl`` (fsync) before its rows are read, and a source opened again reads
the log first, so a restarted oracle, or a resumed run, sees the same rows in the same
order. Each part is converted as the batch format converts one file, into its own cache
(`common.data.convert`).

A bad row never stops a stream: parts are read with ``on_error = "skip"``, and the lines a
part lost are found again (`common.data.raw.bad_lines`) and kept, with their part, line and
what is wrong, in ``quarantine.jsonl`` beside the log. The good rows of the part train.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from common.data.files import is_pattern
from common.data.raw import BadLine
from common.data.spec import DataSpec
from common.data.spool import Spool
from common.data.synthetic import Rows
from common.errors import ConfigError

log = logging.getLogger(__name__)
SUCCESS = "_SUCCESS"
LOG_NAME = "parts.jsonl"
QUARANTINE = "quarantine.jsonl"
SPOOL = "spool"
OPEN_PARTS = 4  # part data sets kept open: reads go forward, across at most two parts


@dataclass(frozen=True, kw_only=True)
class TakenPart:
    """A part of the stream: its file, when it was taken, and its rows (after any skipped)."""

    path: str
    bytes: int
    mtime_ns: int
    rows: int
    taken_s: float  # time.time() when it was taken: where a row's freshness starts
    bad_rows: int = 0  # lines dropped as malformed (kept in the quarantine)


def watch_root(spec: DataSpec) -> Path:
    """The folder a watched `path` lies in: its pattern's first plain folder."""
    path = Path(str(spec.path))
    while is_pattern(str(path)):
        path = path.parent
    return path


def watch_pattern(spec: DataSpec) -> str:
    """The glob of a watched `path`: the pattern itself, or a folder's visible files."""
    path = str(spec.path)
    if is_pattern(path):
        return path
    return str(Path(path) / ("*" if spec.ready == "renamed" else "*/*"))


def complete_parts(spec: DataSpec) -> list[Path]:
    """The complete parts under a watched `path` now, in natural order."""
    import glob

    root = watch_root(spec)
    found = []
    for name in glob.glob(watch_pattern(spec)):
        p = Path(name)
        if p.name.startswith((".", "_")) or not p.is_file():
            continue
        if spec.ready == "success" and not (p.parent / SUCCESS).is_file():
            continue
        found.append(p)
    return sorted(found, key=lambda p: _natural_key(p, root))


def _natural_key(path: Path, root: Path) -> list[object]:
    rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", rel)]


class StreamLog:
    """The parts taken, in order, in ``<folder>/parts.jsonl``: one JSON line per part,
    appended and fsynced before the part's rows are read. A torn last line (a crash while
    appending) is dropped on reading: that part was never read."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOG_NAME
        self.quarantine = folder / QUARANTINE

    def read(self) -> list[TakenPart]:
        if not self.path.is_file():
            return []
        parts = []
        lines = self.path.read_bytes().split(b"\n")
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                parts.append(TakenPart(**orjson.loads(line)))
            except (orjson.JSONDecodeError, TypeError) as exc:
                if n == len(lines) or (n == len(lines) - 1 and not lines[-1]):
                    log.warning("%s: dropping a torn last line (%s)", self.path, exc)
                    self._truncate(sum(len(x) + 1 for x in lines[: n - 1]))
                    break
                raise ConfigError("data.watch", f"{self.path} line {n} is not a part record: {exc}") from None
        return parts

    def append(self, part: TakenPart) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as fh:
            fh.write(orjson.dumps(dataclasses.asdict(part)) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())

    def keep_bad(self, part: Path, bad: list[BadLine]) -> None:
        """Append a part's bad lines to the quarantine (fsync)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.quarantine, "ab") as fh:
            fh.write(b"".join(orjson.dumps({"part": str(part), "line": b.line, "why": b.why, "text": b.text}) + b"\n"
                             for b in bad))
            fh.flush()
            os.fsync(fh.fileno())

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as fh:
            fh.truncate(size)


class LiveSource:
    """The rows of a watched folder, in the order its parts were taken.

    `refresh` takes the parts completed since the last call (log first, then the folder,
    then the rows pushed to the oracle: `spool`), converting each; `rows` reads rows already taken. Both run on the caller's thread (the
    oracle's planner): converting a part is the only way its rows come to be, and nothing
    is read ahead of what the planner asks for.
    """

    def __init__(self, spec: DataSpec, log_folder: Path, *,
                 open_part: Callable[[DataSpec], object] | None = None) -> None:
        if not spec.watch:
            raise ValueError("LiveSource needs a spec with watch = true")
        self.spec = spec
        self.log = StreamLog(log_folder)
        self._open_part = open_part or _open_part_dataset
        self.parts: list[TakenPart] = []
        self._bad_rows = 0  # of the parts taken (scraped with the metrics: not summed each time)
        self._starts = [0]  # rows before each part, and the total
        self._logged = self.log.read()
        self._open: OrderedDict[int, object] = OrderedDict()
        self._lock = threading.Lock()
        self.spool = Spool(spec, log_folder / SPOOL)  # rows pushed to the oracle (POST /v1/ingest)

    @property
    def num_rows(self) -> int:
        return self._starts[-1]

    def taken_s(self, row: int) -> float:
        """When the part holding `row` (taken) was taken."""
        k = int(np.searchsorted(self._starts, row, side="right")) - 1
        return self.parts[min(k, len(self.parts) - 1)].taken_s

    @property
    def bad_rows(self) -> int:
        """Lines of the parts taken that were malformed (quarantined, not trained)."""
        return self._bad_rows

    def refresh(self) -> int:
        """Take every part that is complete and not yet taken; the rows taken in all."""
        with self._lock:
            while len(self.parts) < len(self._logged):
                self._take_logged(self._logged[len(self.parts)])
            taken = {p.path for p in self.parts}
            for path in complete_parts(self.spec) + self.spool.parts():
                if str(path) not in taken:
                    self._take_new(path)
            return self.num_rows

    def rows(self, start: int, stop: int) -> Rows:
        """Rows [start, stop) of the stream; they must have been taken."""
        if not 0 <= start <= stop <= self.num_rows:
            raise ValueError(f"rows [{start}, {stop}) not taken yet ({self.num_rows} taken)")
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        k = first
        while start < stop:
            part_stop = min(stop, self._starts[k + 1])
            if part_stop > start:
                pieces.append(self._part(k).rows(start - self._starts[k], part_stop - self._starts[k]))
            start = part_stop
            k += 1
        if len(pieces) == 1:
            return pieces[0]
        return Rows(labels=np.concatenate([p.labels for p in pieces]), dense=np.concatenate([p.dense for p in pieces]),
                    sparse=np.concatenate([np.asarray(p.sparse, dtype=np.int64) for p in pieces]))

    # ----------------------------------------------------------------- internals
    def _take_logged(self, part: TakenPart) -> None:
        path = Path(part.path)
        if not path.is_file():
            raise ConfigError("data.path", f"{path}, a part this run has read, is gone: the stream "
                              f"cannot be replayed (its log: {self.log.path})")
        st = path.stat()
        if (st.st_size, st.st_mtime_ns) != (part.bytes, part.mtime_ns):
            raise ConfigError("data.path", f"{path}, a part this run has read, changed since "
                              "(size or modification time): a part must not change once complete")
        self._add(part)

    def _take_new(self, path: Path) -> None:
        self._warn_if_late(path)
        st = path.stat()
        spec = self._part_spec(path)
        dataset = self._open_part(spec)
        rows = int(dataset.num_train_rows)  # type: ignore[attr-defined]
        bad = _skipped_lines(dataset)
        if bad:
            self._quarantine(spec, path, bad)
        part = TakenPart(path=str(path), bytes=st.st_size, mtime_ns=st.st_mtime_ns, rows=rows, taken_s=time.time(),
                         bad_rows=bad)
        self.log.append(part)
        log.info("stream: took %s (%d rows%s)", path.name, rows, f", {bad} bad" if bad else "")
        self._add(part, dataset)

    def _warn_if_late(self, path: Path) -> None:
        """A folder part that sorts before the last folder part taken arrived late."""
        if path.parent == self.spool.folder:
            return
        root = watch_root(self.spec)
        last = next((Path(p.path) for p in reversed(self.parts) if Path(p.path).parent != self.spool.folder), None)
        if last is not None and _natural_key(path, root) < _natural_key(last, root):
            log.warning("%s completed after %s, which sorts after it: taken now, after it", path, last)

    def _quarantine(self, spec: DataSpec, path: Path, count: int) -> None:
        if spec.is_raw:
            from common.data.raw import bad_lines

            found = bad_lines(spec, path)
        else:  # parquet: the rows are counted; which ones, the batch reader in fail mode says
            found = []
        self.log.keep_bad(path, found)
        first = f" (first at line {found[0].line}: {found[0].why})" if found else ""
        log.warning("stream: %s has %d malformed row(s), kept in %s and not trained%s", path, count,
                    self.log.quarantine, first)

    def _add(self, part: TakenPart, dataset: object | None = None) -> None:
        self.parts.append(part)
        self._bad_rows += part.bad_rows
        self._starts.append(self._starts[-1] + part.rows)
        if dataset is not None:
            self._keep_open(len(self.parts) - 1, dataset)

    def _part(self, k: int):  # noqa: ANN202 - a Dataset
        if k not in self._open:
            self._keep_open(k, self._open_part(self._part_spec(Path(self.parts[k].path))))
        self._open.move_to_end(k)
        return self._open[k]

    def _keep_open(self, k: int, dataset: object) -> None:
        self._open[k] = dataset
        while len(self._open) > OPEN_PARTS:
            self._open.popitem(last=False)

    def _part_spec(self, path: Path) -> DataSpec:
        """One part read as the batch format reads one file, cached under the stream's
        own folder (never beside the part, in a folder others write)."""
        from common.data.dataset import cache_path

        cache = Path(self.spec.cache_dir) if self.spec.cache_dir else cache_path(self.spec)
        root = watch_root(self.spec)
        name = str(path.relative_to(root) if path.is_relative_to(root) else path.name).replace(os.sep, "__")
        return dataclasses.replace(self.spec, path=str(path), watch=False, on_error="skip",
                                   cache_dir=str(cache / "parts" / name))


def _skipped_lines(dataset: object) -> int:
    """The malformed lines a part's conversion dropped (its manifest says)."""
    data = getattr(dataset, "data", None)
    source = data.manifest.source if data is not None else {}
    return int(source.get("skipped_lines", 0))


def _open_part_dataset(spec: DataSpec) -> object:
    from common.data.dataset import open_dataset

    return open_dataset(spec)
