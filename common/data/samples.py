"""The real click-log samples shipped in the repository (`samples/README.md`: their origin,
format and terms).

This is the one place in code that names their folder: the tests, the benchmarks and the
tools read them through these constants. A spec names its data relative to the spec file
instead (`examples/local.toml`: ``../samples/...``), as every spec does;
`tests/common/test_self_contained.py` checks that the two agree.
"""

from __future__ import annotations

from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[2] / "samples"  # common/data/ -> the repository root
CRITEO_KAGGLE = SAMPLES / "criteo_kaggle_head8000.tsv"  # 8,000 rows of Kaggle's train.txt
CRITEO_TERABYTE = SAMPLES / "criteo_terabyte_day0_head1000.tsv"  # the first 1,000 rows of day_0
AVAZU = SAMPLES / "avazu_sample100.csv"  # 100 rows, with its header
