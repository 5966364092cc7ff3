from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from common.data.hashing import MISSING, hash_rows, hash_strings, parse_hex8
from common.data.raw import MalformedData, RawReader, dense_transform
from common.data.spec import DataSpec
from tests.common.data.conftest import AVAZU, KAGGLE, TERABYTE

REPO = Path(__file__).resolve().parents[3]


def read_all(spec: DataSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, RawReader]:
    reader = RawReader(spec)
    chunks = list(reader.chunks())
    cat = lambda k: np.concatenate([getattr(c, k) for c in chunks])  # noqa: E731
    return cat("labels"), cat("dense"), cat("ids"), reader


def reference_criteo(path: Path) -> tuple[list[float], list[list[float]], list[list[int]]]:
    """Obviously-correct per-field parser, the executable specification of the format."""
    labels, dense, ids = [], [], []
    for line in path.read_text().splitlines():
        f = line.split("\t")
        labels.append(float(f[0]))
        dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]])
        ids.append([int(x, 16) if x else int(MISSING) for x in f[14:]])
    return labels, dense, ids


@pytest.mark.parametrize("path", [KAGGLE, TERABYTE], ids=["kaggle", "terabyte"])
def test_criteo_matches_reference_parser(path: Path) -> None:
    labels, dense, ids, reader = read_all(DataSpec(format="criteo", path=str(path)))
    ref_labels, ref_dense, ref_ids = reference_criteo(path)
    assert reader.rows == len(ref_labels) == len(labels)
    np.testing.assert_array_equal(labels, ref_labels)
    np.testing.assert_array_equal(dense, np.array(ref_dense, dtype=np.float32))  # bit for bit, on any CPU
    np.testing.assert_array_equal(ids, np.array(ref_ids, dtype=np.uint64))


def test_the_dense_transform_rounds_as_long_double_does() -> None:
    """`dense_transform` gives log1p rounded to float32 as long double (x87) does, on every
    count a Criteo file holds below 2**21 and on values either side of float32's range:
    numpy's own float32 log1p misses that in the last bit (by the CPU's SIMD: libm on AVX2,
    SVML on AVX-512), which would make a conversion's bytes depend on the machine."""
    counts = np.arange(-3, 1 << 21, dtype=np.int64)
    floats = np.array([1e-45, 1e-40, 1e-30, 0.5, 3.25, 1e30, 3e38, np.inf], dtype=np.float32)
    for values in (counts, floats):
        want = np.log1p(np.maximum(values, 0).astype(np.float32).astype(np.longdouble)).astype(np.float32)
        got = dense_transform(values)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


def test_first_kaggle_row_and_missing_values() -> None:
    labels, dense, ids, _ = read_all(DataSpec(format="criteo", path=str(KAGGLE)))
    # Line 1: 0, 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2, 68fd1e64 ... C22 empty
    assert labels[0] == 0.0
    assert dense[0, 0] == pytest.approx(math.log(2)) and dense[0, 4] == pytest.approx(math.log(1383))
    assert dense[0, 11] == 0.0  # missing I12
    assert ids[0, 0] == 0x68FD1E64 and ids[0, 21] == MISSING
    missing = (ids == MISSING).mean(axis=0)
    assert all(0.4 < missing[t] < 0.5 for t in (18, 19, 24, 25))  # C19, C20, C25, C26 (README)


def test_negative_dense_is_clamped(tmp_path: Path) -> None:
    line = "1\t-3\t" + "\t".join(["7"] * 12) + "\t" + "\t".join(["0000000a"] * 26) + "\n"
    (tmp_path / "neg.tsv").write_text(line)
    _, dense, _, _ = read_all(DataSpec(format="criteo", path=str(tmp_path / "neg.tsv")))
    assert dense[0, 0] == 0.0 and dense[0, 1] == pytest.approx(math.log(8))


def test_avazu_fields() -> None:
    labels, dense, ids, reader = read_all(DataSpec(format="avazu", path=str(AVAZU)))
    assert reader.rows == 100 and dense.shape == (100, 0) and ids.shape == (100, 23)
    lines = AVAZU.read_text().splitlines()[1:]
    np.testing.assert_array_equal(labels, [float(x.split(",")[1]) for x in lines])
    # 14102100: 2014-10-21, a Tuesday, hour 0
    assert ids[0, 0] == 0 and ids[0, 1] == 1
    hours = [int(x.split(",")[2][-2:]) for x in lines]
    np.testing.assert_array_equal(ids[:, 0], hours)
    same_site = [x.split(",")[5] == lines[0].split(",")[5] for x in lines]
    np.testing.assert_array_equal(ids[:, 4] == ids[0, 4], same_site)  # site_id column


def test_hex_and_string_hashing() -> None:
    ids, bad = parse_hex8(pa.array(["0000000a", "FFFFFFFF", None, "zz000000", "123", "abcdef012"]))
    assert list(ids[:3]) == [10, 0xFFFFFFFF, MISSING] and list(bad) == [False] * 3 + [True] * 3
    h = hash_strings(pa.array(["a", "a\0", "b", "", None, "a" * 40, "a" * 40]))
    assert len(set(h[:4].tolist())) == 4 and h[4] == MISSING and h[5] == h[6]
    assert (h[:4] < np.uint64(1 << 63)).all()
    rows = hash_rows(np.array([1, 2, MISSING], dtype=np.uint64), table=3, size=100)
    assert rows[2] == 0 and (rows[:2] >= 1).all() and (rows[:2] < 100).all()


_PROBE = """
import numpy as np, pyarrow as pa
from common.data.hashing import hash_rows, hash_strings
print(hash_rows(np.arange(5, dtype=np.uint64), 7, 10131227).tolist(),
      hash_strings(pa.array(["1fbe01fe", "site"])).tolist())
"""


def test_hashing_is_stable_across_processes() -> None:
    here = (
        hash_rows(np.arange(5, dtype=np.uint64), 7, 10131227).tolist(),
        hash_strings(pa.array(["1fbe01fe", "site"])).tolist(),
    )
    out = [
        subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True,
                       check=True, env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip()
        for seed in (1, 2)
    ]  # fmt: skip
    assert out[0] == out[1] == f"{here[0]} {here[1]}"
    # Pinned values: a change here silently remaps every stored data set.
    assert here[0][:2] == [4667719, 5936965]


def test_compiled_hash_is_the_numpy_hash() -> None:
    """The converter hashes with a numba kernel; the numpy `hash_rows` is its specification."""
    from common.data.mapping import RowMapper

    rng = np.random.default_rng(5)
    ids = rng.integers(0, 2**63, (5000, 4), dtype=np.int64).astype(np.uint64)
    ids[rng.random(ids.shape) < 0.2] = MISSING
    ids[:3] = np.array([0, 2**32 - 1, 2**63 - 1], dtype=np.uint64)[:, None]
    sizes = (1, 2, 10131227, 2**31 + 11)
    mapper = RowMapper(sizes=sizes)
    want = np.stack([hash_rows(ids[:, t], t, n) for t, n in enumerate(sizes)], axis=1)
    np.testing.assert_array_equal(mapper.rows_as(ids, np.dtype(np.int64)), want)
    np.testing.assert_array_equal(mapper.rows_as(ids[:, :3], np.dtype(np.int32)), want[:, :3])


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [
        (1, "-0", 0.0), (1, "9223372036854775807", None), (1, "-9223372036854775808", 0.0),
        (1, "9223372036854775808", False), (1, "12345678901234567890", False), (1, "+5", False),
        (1, " 5", False), (1, "-", False), (14, "68FD1E64", 0x68FD1E64), (14, "68fd1e6", False),
        (14, "68fd1e644", False), (0, "1", 1.0), (0, "01", False),
    ],
)  # fmt: skip
def test_criteo_field_rules(tmp_path: Path, field: int, value: str, ok: object) -> None:
    """The rules the compiled parser keeps (the module docstring of common.data.raw)."""
    fields = KAGGLE.read_text().splitlines()[2].split("\t")
    fields[field] = value
    (tmp_path / "f.tsv").write_text("\t".join(fields) + "\r\n")
    if ok is False:
        with pytest.raises(MalformedData, match=f"bad {['label', 'I1'][field] if field < 2 else 'C1'} value"):
            read_all(DataSpec(format="criteo", path=str(tmp_path / "f.tsv")))
        return
    labels, dense, ids, _ = read_all(DataSpec(format="criteo", path=str(tmp_path / "f.tsv")))
    if field == 0:
        assert labels[0] == ok
    elif field == 1 and ok is not None:
        assert dense[0, 0] == ok
    elif field == 1:
        assert dense[0, 0] == np.log1p(np.float32(9223372036854775807))
    else:
        assert ids[0, 0] == ok


def _bad_file(tmp_path: Path, bad_line: str, line_no: int = 3) -> Path:
    lines = KAGGLE.read_text().splitlines()[:6]
    lines[line_no - 1] = bad_line
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f[:-1], "expected 40 fields, got 39"),
        (lambda f: [f[0], "x12", *f[2:]], "bad I1 value 'x12'"),
        (lambda f: [*f[:14], "68fd1eZZ", *f[15:]], "bad C1 value '68fd1eZZ'"),
        (lambda f: [*f[:14], "68fd1e6", *f[15:]], "bad C1 value '68fd1e6'"),
        (lambda f: ["2", *f[1:]], "bad label value '2'"),
        (lambda f: [""], "bad label"),
    ],
)
def test_malformed_line_fails_with_file_and_line(tmp_path: Path, mutate, message: str) -> None:
    fields = KAGGLE.read_text().splitlines()[2].split("\t")
    path = _bad_file(tmp_path, "\t".join(mutate(fields)))
    with pytest.raises(MalformedData) as info:
        read_all(DataSpec(format="criteo", path=str(path)))
    assert info.value.line == 3 and message in str(info.value) and str(path) in str(info.value)


def test_skip_mode_counts_and_drops(tmp_path: Path) -> None:
    lines = KAGGLE.read_text().splitlines()[:10]
    lines[2] = lines[2].rsplit("\t", 1)[0]  # 39 fields
    lines[5] = lines[5].replace("\t", "\tnan", 1)  # bad integer
    (tmp_path / "bad.tsv").write_text("\n".join(lines) + "\n")
    labels, _, ids, reader = read_all(DataSpec(format="criteo", path=str(tmp_path / "bad.tsv"), on_error="skip"))
    good = [line for i, line in enumerate(lines) if i not in (2, 5)]
    assert reader.skipped == 2 and reader.rows == 8 and len(labels) == 8
    assert ids[2, 0] == int(good[2].split("\t")[14], 16)


def test_avazu_bad_header_and_hour(tmp_path: Path) -> None:
    lines = AVAZU.read_text().splitlines()
    (tmp_path / "h.csv").write_text("\n".join(["x" + lines[0], *lines[1:]]) + "\n")
    with pytest.raises(MalformedData, match="header"):
        read_all(DataSpec(format="avazu", path=str(tmp_path / "h.csv")))
    bad = lines[4].split(",")
    bad[2] = "14023100"  # 31 February
    (tmp_path / "d.csv").write_text("\n".join([*lines[:4], ",".join(bad), *lines[5:]]) + "\n")
    with pytest.raises(MalformedData) as info:
        read_all(DataSpec(format="avazu", path=str(tmp_path / "d.csv")))
    assert info.value.line == 5 and "hour" in str(info.value)


def test_avazu_headerless_split_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Split files cut from Avazu's train.csv often lack the header: read line 1 as data."""
    lines = AVAZU.read_text().splitlines()
    (tmp_path / "dev.csv").write_text("\n".join(lines[1:]) + "\n")
    want_labels, _, want_ids, _ = read_all(DataSpec(format="avazu", path=str(AVAZU)))
    with caplog.at_level("WARNING", logger="common.data.raw"):
        labels, _, ids, reader = read_all(DataSpec(format="avazu", path=str(tmp_path / "dev.csv")))
    assert reader.rows == 100 and "dev.csv has no header line: read as headerless" in caplog.text
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(ids, want_ids)
    bad = lines[1:]
    bad[3] = bad[3].replace(",14102100,", ",14023100,", 1)  # 31 February, on line 4 of this file
    (tmp_path / "bad.csv").write_text("\n".join(bad) + "\n")
    with pytest.raises(MalformedData) as info:
        read_all(DataSpec(format="avazu", path=str(tmp_path / "bad.csv")))
    assert info.value.line == 4 and "hour" in str(info.value)


def test_avazu_unlabelled_test_header_is_named(tmp_path: Path) -> None:
    """Avazu's own test.csv has a header without the click column (and no labels)."""
    lines = AVAZU.read_text().splitlines()
    drop = lambda line: ",".join(f for i, f in enumerate(line.split(",")) if i != 1)  # noqa: E731
    (tmp_path / "test.csv").write_text("\n".join(drop(x) for x in lines[:5]) + "\n")
    with pytest.raises(MalformedData, match="unlabelled test file \\(no click column\\)") as info:
        read_all(DataSpec(format="avazu", path=str(tmp_path / "test.csv")))
    assert info.value.line == 1
