from __future__ import annotations

from pathlib import Path

import pytest

from common.data.samples import AVAZU
from common.data.samples import CRITEO_KAGGLE as KAGGLE
from common.data.samples import CRITEO_TERABYTE as TERABYTE

__all__ = ["AVAZU", "KAGGLE", "TERABYTE"]  # the samples, by the names the data tests use


@pytest.fixture(scope="session")
def kaggle() -> Path:
    assert KAGGLE.is_file(), f"sample missing: {KAGGLE}"
    return KAGGLE
