"""Rows pushed to a stream (``POST /v1/ingest`` on the oracle): each accepted body becomes a
part of the stream, on disk before it is acknowledged (docs/design.md#online-training).

A body is written to a hidden file in the spool folder, fsynced, checked as the stream's
format reads a file (every line of a text body, every row of a parquet one), and only then
renamed to ``ingest-<sequence>.<ext>`` and the folder fsynced: a body acknowledged is never
lost, a body refused leaves nothing behind. The spool's parts are taken into the stream
after the watched folder's, in sequence order (`common.data.live.LiveSource`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from common.data.chunks import MalformedData
from common.data.spec import DataSpec
from common.errors import BadRequest, ConfigError
from common.files import fsync_folder

PREFIX = "ingest-"
EXTENSIONS = {"criteo": ".tsv", "criteo-terabyte": ".tsv", "avazu": ".csv", "parquet": ".parquet"}


@dataclass(frozen=True, kw_only=True)
class Ingested:
    """A body accepted: the part it became, and its rows."""

    part: str
    rows: int


class Spool:
    """The spool folder of a stream whose `spec` (watch = true) says the body's format."""

    def __init__(self, spec: DataSpec, folder: Path) -> None:
        self.spec, self.folder = spec, folder
        self._lock = threading.Lock()  # one body renamed at a time: sequence = order acknowledged
        self._next: int | None = None

    def parts(self) -> list[Path]:
        """The accepted parts, in sequence order."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.name.startswith(PREFIX) and p.is_file())

    def accept(self, body: bytes) -> Ingested:
        """Make `body` a part, durably (blocking: call it off the event loop). BadRequest
        naming the line (text) or row (parquet) for a body the format cannot read whole."""
        if not body:
            raise BadRequest("an empty body holds no rows")
        self.folder.mkdir(parents=True, exist_ok=True)
        ext = EXTENSIONS[self.spec.format]
        tmp = self.folder / f".body-{threading.get_ident()}-{os.getpid()}{ext}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            rows = self._checked_rows(tmp)
            with self._lock:
                name = f"{PREFIX}{self._sequence():012d}{ext}"
                os.replace(tmp, self.folder / name)
                fsync_folder(self.folder)
                self._next = (self._next or 0) + 1
        finally:
            tmp.unlink(missing_ok=True)
        return Ingested(part=name, rows=rows)

    def _sequence(self) -> int:
        if self._next is None:
            existing = [int(p.name[len(PREFIX):].split(".")[0]) for p in self.parts()]
            self._next = max(existing, default=-1) + 1
        return self._next

    def _checked_rows(self, path: Path) -> int:
        """The rows of a body file, every one checked; BadRequest at the first bad one."""
        spec = dataclasses.replace(self.spec, path=str(path), watch=False, on_error="fail")
        try:
            if spec.is_raw:
                return _text_rows(spec, path)
            return _parquet_rows(spec, path)
        except MalformedData as exc:
            where = f"line {exc.line}" if exc.line is not None else f"row {exc.row}" if exc.row is not None else "body"
            raise BadRequest(f"{where}: {exc.why}", line=exc.line, row=exc.row) from None


def _text_rows(spec: DataSpec, path: Path) -> int:
    from common.data.raw import bad_lines, header_lines, raw_format

    bad = bad_lines(spec, path)
    if bad:
        first = bad[0]
        more = f" ({len(bad)} bad lines in all)" if len(bad) > 1 else ""
        raise MalformedData(path, first.line, f"{first.why}{more}")
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.count(b"\n") + (not data.endswith(b"\n"))
    return lines - header_lines(raw_format(spec), path)


def _parquet_rows(spec: DataSpec, path: Path) -> int:
    import pyarrow as pa

    from common.data.in_place import open_in_place

    try:
        dataset = open_in_place(spec)
    except (pa.ArrowInvalid, OSError, ConfigError) as exc:
        raise MalformedData(path, None, f"is not a parquet file the stream's columns can be read from: {exc}") from None
    dataset.rows(0, dataset.num_rows)  # reads and checks every row
    return dataset.num_rows
