"""The data pipeline: source readers (raw logs, TorchRec npy days, parquet), the
preprocessed format and the parallel conversion into it, synthetic data, skew statistics.

Start with `parse_data_spec` (the ``[data]`` section of the cluster spec) and
`open_dataset`, which gives fixed-order training batches and the held-out evaluation rows
for every format (`dataset.access` decides how each is read). ``python -m common.data
--help`` lists the command-line tools.
"""

from __future__ import annotations

import importlib

# Loaded on first use (PEP 562): a role that needs only the `[data]` section's parsing
# (every trainer and PS, through `common.job`) does not load pyarrow and the readers.
_HOMES = {
    "MalformedData": "common.data.chunks",
    "RawChunk": "common.data.chunks",
    "Reader": "common.data.chunks",
    "convert": "common.data.convert",
    "open_reader": "common.data.convert",
    "Batch": "common.data.dataset",
    "Dataset": "common.data.dataset",
    "access": "common.data.dataset",
    "cache_path": "common.data.dataset",
    "open_dataset": "common.data.dataset",
    "NpyDaysReader": "common.data.npy",
    "ParquetReader": "common.data.parquet",
    "Manifest": "common.data.preprocessed",
    "Preprocessed": "common.data.preprocessed",
    "open_preprocessed": "common.data.preprocessed",
    "RawReader": "common.data.raw",
    "CRITEO_KAGGLE_SIZES": "common.data.spec",
    "DataSpec": "common.data.spec",
    "parse_data_spec": "common.data.spec",
    "SkewReport": "common.data.stats",
    "format_table": "common.data.stats",
    "plot_coverage": "common.data.stats",
    "skew_stats": "common.data.stats",
    "SyntheticGenerator": "common.data.synthetic",
    "calibrate_exponents": "common.data.synthetic",
    "overall_top_share": "common.data.synthetic",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'common.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
