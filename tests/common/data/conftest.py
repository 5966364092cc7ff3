from __future__ import annotations

from pathlib import Path

import pytest

# CI clones the repository with shared/ beside it, so go through the repo root's parent.
SHARED_DATA = Path(__file__).resolve().parents[3] / ".." / "shared" / "data"
KAGGLE = SHARED_DATA / "criteo_kaggle_head8000.tsv"
TERABYTE = SHARED_DATA / "criteo_terabyte_day0_head1000.tsv"
AVAZU = SHARED_DATA / "avazu_sample100.csv"


@pytest.fixture(scope="session")
def kaggle() -> Path:
    assert KAGGLE.is_file(), f"sample missing: {KAGGLE}"
    return KAGGLE
