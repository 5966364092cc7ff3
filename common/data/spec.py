"""The ``[data]`` section of the cluster spec, parsed into a frozen, validated `DataSpec`.

A bad or unknown key raises ``ConfigError("data.<field>", ...)``; nothing silently falls
back to a default. Relative paths are resolved against the folder of the spec file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from common.errors import ConfigError

Format = Literal["criteo", "criteo-terabyte", "avazu", "criteo-npy", "parquet", "synthetic", "preprocessed"]
FORMATS: tuple[str, ...] = (
    "criteo", "criteo-terabyte", "avazu", "criteo-npy", "parquet", "synthetic", "preprocessed",
)  # fmt: skip
RAW_FORMATS: tuple[str, ...] = ("criteo", "criteo-terabyte", "avazu")  # text click logs
# Formats whose categorical values are integers that may already be rows (hashing = "none").
ID_FORMATS: tuple[str, ...] = ("criteo-npy", "parquet")
Hashing = Literal["hash", "dictionary", "none"]
OnError = Literal["fail", "skip"]
DenseTransform = Literal["none", "log1p"]
Ready = Literal["renamed", "success"]
# Formats a watched folder streams: one file is one part (criteo-npy days are three files).
WATCH_FORMATS: tuple[str, ...] = ("criteo", "criteo-terabyte", "avazu", "parquet")
# Keys only one format takes (a key set for another format is refused, not ignored).
FORMAT_KEYS: dict[str, str] = {
    "sparse_path": "criteo-npy", "label_column": "parquet", "dense_columns": "parquet",
    "sparse_columns": "parquet", "dense_transform": "parquet",
}  # fmt: skip

# Criteo Kaggle cardinalities after the usual dictionary encoding (samples/README.md).
CRITEO_KAGGLE_SIZES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
CRITEO_NUM_DENSE = 13
CRITEO_DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, 14))
CRITEO_SPARSE_NAMES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
# Avazu: hour of day and weekday map directly (row 0 stays the missing row, as everywhere);
# the 21 other columns hash into 2**20 rows each unless the spec says otherwise.
AVAZU_DIRECT_SIZES: tuple[int, ...] = (25, 8)
AVAZU_DEFAULT_HASHED_SIZE = 1 << 20
AVAZU_SIZES: tuple[int, ...] = AVAZU_DIRECT_SIZES + (AVAZU_DEFAULT_HASHED_SIZE,) * 21


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where the data comes from and how categorical values become rows.

    `table_sizes` is empty only where the data decides it: dictionary hashing without a
    cap, or a preprocessed directory (sizes come from its manifest). Otherwise it holds one
    size per table and every row id is in ``[0, size)``; row 0 is the missing-value row.
    ``hashing = "none"`` (criteo-npy, parquet) takes integer ids as rows, as they are.
    """

    format: Format
    # a file, a folder, a glob pattern, or a list of those (`common.data.files`)
    path: str | tuple[str, ...] | None = None
    cache_dir: str | None = None
    table_sizes: tuple[int, ...] = ()
    hashing: Hashing = "hash"
    min_frequency: int = 1
    eval_fraction: float = 0.0
    seed: int = 0
    on_error: OnError = "fail"
    workers: int = 0  # conversion processes; 0: one per core
    # a live stream (`common.data.live`): `path` is watched for parts as they complete
    watch: bool = False
    ready: Ready = "renamed"  # how a part shows it is complete: renamed into place, or _SUCCESS
    poll_s: float = 1.0  # how often a watched folder is listed
    # synthetic only
    rows: int = 1_000_000
    top1_share: float = 0.92
    drift: float = 0.0
    click_rate: float = 0.25
    num_dense: int = CRITEO_NUM_DENSE
    # criteo-npy only: the folder of the day_N_sparse*.npy files, when not `path`
    sparse_path: str | None = None
    # parquet only
    label_column: str = "label"
    dense_columns: tuple[str, ...] = CRITEO_DENSE_NAMES
    sparse_columns: tuple[str, ...] = CRITEO_SPARSE_NAMES
    dense_transform: DenseTransform = "none"

    def __post_init__(self) -> None:
        _check_choice("format", self.format, FORMATS)
        _check_choice("hashing", self.hashing, ("hash", "dictionary", "none"))
        _check_choice("on_error", self.on_error, ("fail", "skip"))
        _check_choice("dense_transform", self.dense_transform, ("none", "log1p"))
        if self.format != "synthetic" and not self.path:
            raise ConfigError("data.path", f"is required for format {self.format!r}")
        if not isinstance(self.path, (str, type(None))):
            object.__setattr__(self, "path", tuple(self.path))
            if any(type(p) is not str or not p for p in self.path):
                raise ConfigError("data.path", f"a list of paths must hold non-empty strings, got {list(self.path)!r}")
            if self.format in ("criteo-npy", "preprocessed"):
                raise ConfigError("data.path", f"{self.format} reads one folder, not a list")
        if self.hashing == "none" and self.format not in ID_FORMATS:
            raise ConfigError("data.hashing", f"'none' takes integer ids as rows: only {', '.join(ID_FORMATS)} "
                              "have them")  # fmt: skip
        if self.format == "parquet":
            self._check_columns()
        self._check_watch()
        object.__setattr__(self, "table_sizes", self._default_sizes())
        for t, n in enumerate(self.table_sizes):
            if type(n) is not int or n < 1:
                raise ConfigError(f"data.table_sizes[{t}]", f"must be a positive integer, got {n!r}")
        if self.hashing == "dictionary" and any(n < 2 for n in self.table_sizes):
            raise ConfigError("data.table_sizes", "dictionary tables need >= 2 rows (missing, rare)")
        _check_int("min_frequency", self.min_frequency, 1)
        _check_int("rows", self.rows, 1)
        _check_int("seed", self.seed, 0)
        _check_int("workers", self.workers, 0)
        _check_int("num_dense", self.num_dense, 0)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError("data.eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if not 0.01 < self.top1_share < 1.0:
            raise ConfigError("data.top1_share", f"must be in (0.01, 1), got {self.top1_share}")
        if not 0.0 < self.click_rate < 1.0:
            raise ConfigError("data.click_rate", f"must be in (0, 1), got {self.click_rate}")
        if not (self.drift >= 0.0 and math.isfinite(self.drift)):
            raise ConfigError("data.drift", f"must be a finite number >= 0, got {self.drift}")
        if self.format == "avazu" and self.table_sizes:
            self._check_avazu_sizes()
        if self.format in ID_FORMATS and self.table_sizes and len(self.table_sizes) != self.num_tables:
            raise ConfigError("data.table_sizes", f"{self.format} data here has {self.num_tables} tables, "
                              f"got {len(self.table_sizes)} sizes")  # fmt: skip

    def _check_watch(self) -> None:
        _check_choice("ready", self.ready, ("renamed", "success"))
        if not (self.poll_s > 0 and math.isfinite(self.poll_s)):
            raise ConfigError("data.poll_s", f"must be a finite number > 0, got {self.poll_s}")
        if not self.watch:
            return
        if self.format not in WATCH_FORMATS:
            raise ConfigError("data.watch", f"a stream's parts are single files: only {', '.join(WATCH_FORMATS)} "
                              f"can be watched, not {self.format}")  # fmt: skip
        if not isinstance(self.path, str):
            raise ConfigError("data.path", "a watched stream is one folder or glob pattern, not a list")
        if self.hashing == "dictionary":
            raise ConfigError("data.hashing", "a dictionary needs every row before the first batch: a watched "
                              "stream hashes ('hash', or 'none' for ids)")  # fmt: skip
        if self.eval_fraction:
            raise ConfigError("data.eval_fraction", "a stream has no last rows to hold out: set 0 with watch")
        if self.on_error != "skip":
            raise ConfigError("data.on_error", "a stream never stops on a bad row (it quarantines it): "
                              "leave on_error out, or set 'skip'")  # fmt: skip

    @property
    def num_tables(self) -> int:
        """Tables of an ID format (criteo-npy: Criteo's 26; parquet: one per sparse column)."""
        return len(self.sparse_columns) if self.format == "parquet" else len(CRITEO_SPARSE_NAMES)

    def _default_sizes(self) -> tuple[int, ...]:
        """Explicit sizes, else the format's default; empty where the data decides."""
        if self.table_sizes:
            return tuple(self.table_sizes)
        if self.format == "synthetic":
            return CRITEO_KAGGLE_SIZES
        if self.hashing == "dictionary" or self.format == "preprocessed":
            return ()
        if self.hashing == "none":
            raise ConfigError("data.table_sizes", "is required with hashing = 'none' (the ids are rows: "
                              "say how many each table has)")  # fmt: skip
        if self.format == "parquet" and len(self.sparse_columns) != len(CRITEO_KAGGLE_SIZES):
            raise ConfigError("data.table_sizes", f"is required: only Criteo's 26 tables have default sizes, "
                              f"sparse_columns has {len(self.sparse_columns)}")  # fmt: skip
        return AVAZU_SIZES if self.format == "avazu" else CRITEO_KAGGLE_SIZES

    def _check_columns(self) -> None:
        groups = {"label_column": (self.label_column,), "dense_columns": self.dense_columns,
                  "sparse_columns": self.sparse_columns}  # fmt: skip
        seen: set[str] = set()
        for key, names in groups.items():
            if key == "sparse_columns" and not names:
                raise ConfigError("data.sparse_columns", "must name at least one column")
            for name in names:
                if type(name) is not str or not name:
                    raise ConfigError(f"data.{key}", f"column names must be non-empty strings, got {name!r}")
                if name in seen:
                    raise ConfigError(f"data.{key}", f"column {name!r} is named twice")
                seen.add(name)

    def _check_avazu_sizes(self) -> None:
        if len(self.table_sizes) != len(AVAZU_SIZES):
            raise ConfigError("data.table_sizes", f"avazu has {len(AVAZU_SIZES)} tables")
        if self.hashing == "hash" and self.table_sizes[:2] < AVAZU_DIRECT_SIZES:
            raise ConfigError(
                "data.table_sizes", f"avazu hour/weekday tables need at least {AVAZU_DIRECT_SIZES}"
            )

    @property
    def is_raw(self) -> bool:
        """A text click log (criteo, criteo-terabyte, avazu)."""
        return self.format in RAW_FORMATS


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"data.{field}", f"must be one of {', '.join(choices)}; got {value!r}")


def _check_int(field: str, value: object, low: int) -> None:
    if type(value) is not int or value < low:
        raise ConfigError(f"data.{field}", f"must be an integer >= {low}, got {value!r}")


_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,), "path": (str, list), "cache_dir": (str,), "workers": (int,), "table_sizes": (list, tuple),
    "hashing": (str,), "min_frequency": (int,), "eval_fraction": (float, int), "seed": (int,),
    "on_error": (str,), "rows": (int,), "top1_share": (float, int), "drift": (float, int),
    "click_rate": (float, int), "num_dense": (int,), "num_tables": (int,), "sparse_path": (str,),
    "label_column": (str,), "dense_columns": (list, tuple), "sparse_columns": (list, tuple),
    "dense_transform": (str,), "watch": (bool,), "ready": (str,), "poll_s": (float, int),
}  # fmt: skip
_WATCH_KEYS = ("ready", "poll_s")  # only a watched stream takes them


def parse_data_spec(section: dict[str, Any], *, base_dir: Path) -> DataSpec:
    """Build a `DataSpec` from the ``[data]`` TOML section.

    Defaults: criteo formats hash into Criteo Kaggle's 26 published cardinalities; avazu
    into `AVAZU_SIZES`; synthetic uses Criteo Kaggle's cardinalities (or the first
    `num_tables` of them); dictionary hashing sizes tables from the data (explicit sizes
    then cap them). `path` (each entry of a list, glob patterns too), `cache_dir` and
    `sparse_path` are resolved against `base_dir`.
    Raises ConfigError naming the first bad or unknown field.
    """
    for key, value in section.items():
        if key not in _TYPES:
            raise ConfigError(f"data.{key}", "unknown key")
        if not isinstance(value, _TYPES[key]) or (isinstance(value, bool) and bool not in _TYPES[key]):
            raise ConfigError(f"data.{key}", f"has the wrong type ({type(value).__name__})")
        if key in _WATCH_KEYS and section.get("watch") is not True:
            raise ConfigError(f"data.{key}", "only a watched stream (watch = true) takes it")
        if key in FORMAT_KEYS and section.get("format") != FORMAT_KEYS[key]:
            raise ConfigError(f"data.{key}", f"only format {FORMAT_KEYS[key]!r} takes it")
    if "format" not in section:
        raise ConfigError("data.format", f"is required: one of {FORMATS}")
    fields = dict(section)
    fields.pop("num_tables", None)
    for key in ("cache_dir", "sparse_path"):
        if key in fields:
            fields[key] = str((base_dir / fields[key]).resolve())
    if isinstance(fields.get("path"), list):
        if not fields["path"] or any(type(p) is not str or not p for p in fields["path"]):
            raise ConfigError("data.path", "a list of paths must hold one or more non-empty strings")
        fields["path"] = tuple(str((base_dir / p).resolve()) for p in fields["path"])
    elif "path" in fields:
        fields["path"] = str((base_dir / fields["path"]).resolve())
    for key in ("dense_columns", "sparse_columns"):
        if key in fields:
            fields[key] = tuple(fields[key])
    for key in ("eval_fraction", "top1_share", "drift", "click_rate", "poll_s"):
        if key in fields:
            fields[key] = float(fields[key])
    fields["table_sizes"] = _table_sizes(section)
    if section.get("watch") is True:
        fields.setdefault("on_error", "skip")  # a stream's bad rows are quarantined, never fatal
    if section.get("format") not in ("synthetic", None) and "num_dense" in section:
        raise ConfigError("data.num_dense", "is set by the format; only synthetic data takes it")
    return DataSpec(**fields)


def _table_sizes(section: dict[str, Any]) -> tuple[int, ...]:
    """Explicit sizes, or the first `num_tables` Kaggle sizes (synthetic), or () = default."""
    if "num_tables" not in section:
        return tuple(section.get("table_sizes", ()))
    n = section["num_tables"]
    if section.get("format") != "synthetic" or "table_sizes" in section:
        raise ConfigError("data.num_tables", "only synthetic data without table_sizes takes it")
    if not 1 <= n <= len(CRITEO_KAGGLE_SIZES):
        raise ConfigError("data.num_tables", f"must be in 1..26, got {n}")
    return CRITEO_KAGGLE_SIZES[:n]
