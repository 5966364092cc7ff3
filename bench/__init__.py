"""Benchmarks: each prints a table and, with ``--json PATH``, writes its figures there."""

from __future__ import annotations

from pathlib import Path

import orjson


def write_json(path: Path | None, figures: object) -> None:
    """Write `figures` to `path` as indented JSON (numpy values allowed); no path, no file."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
