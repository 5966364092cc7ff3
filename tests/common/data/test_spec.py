from __future__ import annotations

from pathlib import Path

import pytest

from common.data.spec import AVAZU_SIZES, CRITEO_KAGGLE_SIZES, DataSpec, parse_data_spec
from common.errors import ConfigError


def test_defaults_per_format(tmp_path: Path) -> None:
    criteo = parse_data_spec({"format": "criteo", "path": "x.tsv"}, base_dir=tmp_path)
    assert criteo.table_sizes == CRITEO_KAGGLE_SIZES and sum(criteo.table_sizes) == 33_762_577
    assert criteo.path == str(tmp_path / "x.tsv")
    assert parse_data_spec({"format": "avazu", "path": "a"}, base_dir=tmp_path).table_sizes == AVAZU_SIZES
    assert parse_data_spec({"format": "criteo", "path": "a", "hashing": "dictionary"}, base_dir=tmp_path).table_sizes == ()
    synth = parse_data_spec({"format": "synthetic", "num_tables": 3, "rows": 10}, base_dir=tmp_path)
    assert synth.table_sizes == CRITEO_KAGGLE_SIZES[:3] and synth.num_dense == 13
    npy = parse_data_spec({"format": "criteo-npy", "path": "days", "sparse_path": "contig"}, base_dir=tmp_path)
    assert npy.table_sizes == CRITEO_KAGGLE_SIZES and npy.sparse_path == str(tmp_path / "contig")
    pq = parse_data_spec({"format": "parquet", "path": "p", "sparse_columns": ["u", "i"], "hashing": "none",
                          "table_sizes": [5, 7], "dense_columns": []}, base_dir=tmp_path)  # fmt: skip
    assert pq.sparse_columns == ("u", "i") and pq.dense_columns == () and pq.table_sizes == (5, 7)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"format": "orc", "path": "a"}, "data.format"),
        ({"format": "criteo"}, "data.path"),
        ({"format": "criteo", "path": "a", "hashing": "md5"}, "data.hashing"),
        ({"format": "criteo", "path": "a", "eval_fraction": 1.0}, "data.eval_fraction"),
        ({"format": "criteo", "path": "a", "on_error": "ignore"}, "data.on_error"),
        ({"format": "criteo", "path": "a", "table_sizes": [10, 0]}, "data.table_sizes[1]"),
        ({"format": "criteo", "path": "a", "min_frequency": 0}, "data.min_frequency"),
        ({"format": "criteo", "path": "a", "batch": 3}, "data.batch"),
        ({"format": "criteo", "path": "a", "seed": "1"}, "data.seed"),
        ({"format": "criteo", "path": "a", "num_dense": 4}, "data.num_dense"),
        ({"format": "synthetic", "top1_share": 1.5}, "data.top1_share"),
        ({"format": "synthetic", "num_tables": 27}, "data.num_tables"),
        ({"format": "avazu", "path": "a", "table_sizes": [10] * 23}, "data.table_sizes"),
        ({"format": "criteo", "path": "a", "sparse_path": "b"}, "data.sparse_path"),
        ({"format": "criteo-npy", "path": "a", "label_column": "y"}, "data.label_column"),
        ({"format": "criteo", "path": "a", "hashing": "none", "table_sizes": [9] * 26}, "data.hashing"),
        ({"format": "criteo-npy", "path": "a", "hashing": "none"}, "data.table_sizes"),
        ({"format": "criteo-npy", "path": "a", "table_sizes": [9] * 3}, "data.table_sizes"),
        ({"format": "parquet", "path": "a", "sparse_columns": ["a", "b"]}, "data.table_sizes"),
        ({"format": "parquet", "path": "a", "sparse_columns": ["a", "b"], "table_sizes": [9]}, "data.table_sizes"),
        ({"format": "parquet", "path": "a", "sparse_columns": []}, "data.sparse_columns"),
        ({"format": "parquet", "path": "a", "dense_columns": ["I1", 2]}, "data.dense_columns"),
        ({"format": "parquet", "path": "a", "dense_columns": ["C1"]}, "data.sparse_columns"),
        ({"format": "parquet", "path": "a", "label_column": "I3"}, "data.dense_columns"),
        ({"format": "parquet", "path": "a", "dense_transform": "log"}, "data.dense_transform"),
        ({"path": "a"}, "data.format"),
        ({"format": "criteo", "path": "a", "workers": -1}, "data.workers"),
        ({"format": "criteo", "path": "a", "workers": 1.5}, "data.workers"),
        ({"format": "criteo", "path": []}, "data.path"),
        ({"format": "criteo", "path": ["a", ""]}, "data.path"),
        ({"format": "criteo", "path": ["a", 3]}, "data.path"),
        ({"format": "criteo-npy", "path": ["a", "b"]}, "data.path"),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, section: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_data_spec(section, base_dir=tmp_path)
    assert info.value.field == field


def test_paths_workers_and_patterns(tmp_path: Path) -> None:
    listed = parse_data_spec({"format": "criteo", "path": ["d/day_1.gz", "d/day_0.gz"], "workers": 3},
                             base_dir=tmp_path)  # fmt: skip
    assert listed.path == (str(tmp_path / "d/day_1.gz"), str(tmp_path / "d/day_0.gz")) and listed.workers == 3
    pattern = parse_data_spec({"format": "parquet", "path": "p/part-*.parquet"}, base_dir=tmp_path)
    assert pattern.path == str(tmp_path / "p" / "part-*.parquet") and pattern.workers == 0  # 0: every core


def test_spec_is_frozen() -> None:
    spec = DataSpec(format="synthetic")
    with pytest.raises(AttributeError):
        spec.seed = 3  # type: ignore[misc]
