from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from common.errors import BadRequest, ConfigError
from common.init import initial_rows
from common.keys import TableLayout, global_key, local_index, shard_of, shard_size, split_by_shard

LAYOUT = TableLayout((10, 3, 7))


def test_offsets_and_key_mapping() -> None:
    assert LAYOUT.offsets.tolist() == [0, 10, 13, 20]
    assert LAYOUT.total_rows == 20
    keys = LAYOUT.to_keys(np.array([[9, 0, 6], [0, 2, 0]]))
    assert keys.tolist() == [[9, 10, 19], [0, 12, 13]]
    assert LAYOUT.table_of(np.array([0, 9, 10, 12, 13, 19])).tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("sizes", [(), (3, 0), (2, -1), (1.5,)])
def test_bad_sizes_name_the_field(sizes: tuple) -> None:
    with pytest.raises(ConfigError, match="data.table_sizes"):
        TableLayout(sizes)


def test_check_keys_names_the_bad_key() -> None:
    LAYOUT.check_keys(np.array([0, 19]))
    with pytest.raises(BadRequest, match="key 20"):
        LAYOUT.check_keys(np.array([3, 20]))
    with pytest.raises(BadRequest, match="key -1"):
        LAYOUT.check_keys(np.array([-1]))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_sharding_partitions_the_key_space(num_shards: int) -> None:
    keys = np.arange(LAYOUT.total_rows)
    sizes = [shard_size(LAYOUT.total_rows, s, num_shards) for s in range(num_shards)]
    assert sum(sizes) == LAYOUT.total_rows
    for s in range(num_shards):
        mine = keys[shard_of(keys, num_shards) == s]
        assert len(mine) == sizes[s]
        assert np.array_equal(global_key(local_index(mine, num_shards), s, num_shards), mine)
        assert np.array_equal(local_index(mine, num_shards), np.arange(sizes[s]))


def test_split_by_shard_is_stable_and_complete() -> None:
    keys = np.array([5, 2, 9, 4, 1, 8])
    parts = split_by_shard(keys, 3)
    assert [p.tolist() for p in parts] == [[2], [3, 4], [0, 1, 5]]


@pytest.mark.parametrize("num_shards", [2, 3, 8, 300])
def test_split_by_shard_gives_each_shard_its_positions_in_order(num_shards: int) -> None:
    keys = np.random.default_rng(num_shards).integers(0, 1 << 40, 5_000)
    parts = split_by_shard(keys, num_shards)
    assert len(parts) == num_shards
    for shard, positions in enumerate(parts):
        assert positions.tolist() == np.flatnonzero(keys % num_shards == shard).tolist()


def test_initial_rows_are_pure_in_seed_and_key() -> None:
    keys = np.array([0, 5, 10, 19])
    rows = initial_rows(LAYOUT, 42, keys, 8)
    assert rows.dtype == np.float32 and rows.shape == (4, 8)
    # order and batching do not matter
    assert np.array_equal(initial_rows(LAYOUT, 42, keys[::-1], 8), rows[::-1])
    assert np.array_equal(initial_rows(LAYOUT, 42, keys[2:3], 8), rows[2:3])
    assert not np.array_equal(initial_rows(LAYOUT, 43, keys, 8), rows)
    # DLRM's scale: uniform in ±sqrt(1/n_t)
    bound = np.sqrt(1.0 / np.array([10, 10, 3, 7]))[:, None] * (1 + 1e-6)
    assert (np.abs(rows) <= bound).all()


def test_initial_rows_fill_their_range() -> None:
    layout = TableLayout((4,))
    rows = initial_rows(layout, 0, np.arange(4), 4096)
    assert abs(float(rows.mean())) < 0.02
    assert rows.max() > 0.49 and rows.min() < -0.49


def test_initial_rows_identical_in_another_process() -> None:
    code = (
        "import numpy as np;from common.keys import TableLayout;from common.init import initial_rows;"
        "import sys;sys.stdout.buffer.write(initial_rows(TableLayout((10,3,7)),9,np.arange(20),4).tobytes())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    assert out == initial_rows(LAYOUT, 9, np.arange(20), 4).tobytes()
