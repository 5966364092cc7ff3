"""The data pipeline: source readers (raw logs, TorchRec npy days, parquet), the
preprocessed format and the parallel conversion into it, synthetic data, skew statistics.

Start with `parse_data_spec` (the ``[data]`` section of the cluster spec) and
`open_dataset`, which gives fixed-order training batches and the held-out evaluation rows
for every format (`dataset.access` decides how each is read). ``python -m common.data
--help`` lists the command-line tools.
"""

from __future__ import annotations

from common.data.chunks import MalformedData, RawChunk, Reader
from common.data.convert import convert, open_reader
from common.data.dataset import Batch, Dataset, access, cache_path, open_dataset
from common.data.npy import NpyDaysReader
from common.data.parquet import ParquetReader
from common.data.preprocessed import Manifest, Preprocessed, open_preprocessed
from common.data.raw import RawReader
from common.data.spec import CRITEO_KAGGLE_SIZES, DataSpec, parse_data_spec
from common.data.stats import SkewReport, format_table, plot_coverage, skew_stats
from common.data.synthetic import SyntheticGenerator, calibrate_exponents, overall_top_share

__all__ = [
    "CRITEO_KAGGLE_SIZES", "Batch", "DataSpec", "Dataset", "MalformedData", "Manifest",
    "NpyDaysReader", "ParquetReader", "Preprocessed", "RawChunk", "RawReader", "Reader",
    "SkewReport", "SyntheticGenerator", "access", "cache_path", "calibrate_exponents", "convert",
    "format_table", "open_dataset", "open_preprocessed", "open_reader", "overall_top_share",
    "parse_data_spec", "plot_coverage", "skew_stats",
]  # fmt: skip
