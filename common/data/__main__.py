"""Command line: ``python -m common.data convert|stats|synth ...`` (see ``--help``)."""

from __future__ import annotations

import argparse
import logging
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.data.convert import convert, table_names
from common.data.dataset import open_dataset
from common.data.spec import FORMATS, DataSpec, parse_data_spec
from common.data.stats import format_table, plot_coverage, skew_stats, write_json
from common.data.synthetic import CHUNK_ROWS, write_synthetic
from common.errors import BagpipeError

# argparse destination → [data] key, for the options shared by the commands.
_KEYS = {
    "format": "format", "path": "path", "cache_dir": "cache_dir", "hashing": "hashing",
    "min_frequency": "min_frequency", "table_sizes": "table_sizes", "on_error": "on_error",
    "rows": "rows", "seed": "seed", "top1_share": "top1_share", "drift": "drift",
    "click_rate": "click_rate", "num_dense": "num_dense", "num_tables": "num_tables",
    "sparse_path": "sparse_path", "label_column": "label_column", "dense_columns": "dense_columns",
    "sparse_columns": "sparse_columns", "dense_transform": "dense_transform", "workers": "workers",
}  # fmt: skip


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _data_options(p: argparse.ArgumentParser, *, synthetic: bool) -> None:
    p.add_argument("--spec", type=Path, help="TOML file whose [data] section is the base; flags override it")
    if not synthetic:
        p.add_argument("--format", choices=FORMATS)
        p.add_argument("--path", help="raw file, folder of files or glob pattern ('days/day_*.gz'), folder of npy "
                       "days, parquet file, folder or pattern (or a preprocessed directory)")
        p.add_argument("--hashing", choices=("hash", "dictionary", "none"), help="none: integer ids are rows")
        p.add_argument("--min-frequency", type=int, help="dictionary: rarer values share row 1")
        p.add_argument("--on-error", choices=("fail", "skip"), help="malformed lines: stop (default) or skip")
        p.add_argument("--workers", type=int, help="conversion processes (default: every core)")
        p.add_argument("--sparse-path", help="criteo-npy: folder of the day_N_sparse*.npy files (default --path)")
        p.add_argument("--label-column", help="parquet: the label column (label)")
        p.add_argument("--dense-columns", type=_names, help="parquet: comma-separated dense columns (I1..I13)")
        p.add_argument("--sparse-columns", type=_names, help="parquet: comma-separated id columns (C1..C26)")
        p.add_argument("--dense-transform", choices=("none", "log1p"), help="parquet: dense values as they are "
                       "(none) or raw counts (log1p)")
    p.add_argument("--table-sizes", type=_sizes, help="comma-separated rows per table")
    if synthetic:
        p.add_argument("--rows", type=int)
        p.add_argument("--seed", type=int)
        p.add_argument("--num-tables", type=int, help="first N Criteo Kaggle cardinalities")
        p.add_argument("--num-dense", type=int)
        p.add_argument("--top1-share", type=float, help="share of accesses to the top 1%% of rows (0.92)")
        p.add_argument("--drift", type=float, help="fraction of the hot set replaced per 1M rows (0)")
        p.add_argument("--click-rate", type=float)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m common.data", description="Bagpipe data tools.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="raw click logs, npy days or parquet → preprocessed directory")
    _data_options(c, synthetic=False)
    c.add_argument("--out", type=Path, required=True, help="preprocessed directory to write")
    s = sub.add_parser("stats", help="skew statistics of a data set (table, JSON, PNG)")
    _data_options(s, synthetic=False)
    s.add_argument("--cache-dir", help="where raw sources are converted (default <path>.bagpipe/)")
    s.add_argument("--rows", type=int, help="only the first ROWS rows")
    s.add_argument("--batch-size", type=int, default=4096, help="for reuse distances (4096)")
    s.add_argument("--json", type=Path, help="write the report as JSON")
    s.add_argument("--plot", type=Path, help="write the coverage curves as PNG")
    y = sub.add_parser("synth", help="write a synthetic Criteo-like preprocessed directory")
    _data_options(y, synthetic=True)
    y.add_argument("--out", type=Path, required=True, help="preprocessed directory to write")
    return parser


def spec_from_args(args: argparse.Namespace, *, synthetic: bool = False) -> DataSpec:
    """The [data] section of --spec (if any) overridden by the flags given."""
    section: dict[str, Any] = {}
    base = Path.cwd()
    if args.spec is not None:
        section = dict(tomllib.loads(args.spec.read_text()).get("data", {}))
        base = args.spec.resolve().parent
    for dest, key in _KEYS.items():
        value = getattr(args, dest, None)
        if value is not None and not (dest == "rows" and not synthetic):
            section[key] = str(Path(value).resolve()) if dest in ("path", "cache_dir", "sparse_path") else value
    if synthetic:
        section["format"] = "synthetic"
    return parse_data_spec(section, base_dir=base)


def _convert(args: argparse.Namespace) -> None:
    spec = spec_from_args(args)
    m = convert(spec, args.out)
    print(f"{args.out}: {m.rows:,} rows, {len(m.table_sizes)} tables, {m.num_dense} dense, "
          f"{m.source['skipped_lines']} malformed line(s) skipped")  # fmt: skip


def _stats(args: argparse.Namespace) -> None:
    spec = spec_from_args(args)
    data = open_dataset(spec, progress=True)
    stop = min(args.rows or data.num_rows, data.num_rows)
    chunks = (data.rows(i, min(i + CHUNK_ROWS, stop)).sparse for i in range(0, stop, CHUNK_ROWS))
    report = skew_stats(chunks, data.table_sizes, args.batch_size, table_names(spec))
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    if args.plot:
        plot_coverage(report, args.plot)


def _synth(args: argparse.Namespace) -> None:
    m = write_synthetic(spec_from_args(args, synthetic=True), args.out, progress=True)
    print(f"{args.out}: {m.rows:,} synthetic rows, {len(m.table_sizes)} tables")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        {"convert": _convert, "stats": _stats, "synth": _synth}[args.command](args)
    except BagpipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
