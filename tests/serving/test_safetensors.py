"""Our streamed safetensors writer against the safetensors library's reader, and our lazy
reader against the library's writer; malformed files are refused naming what is wrong."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from safetensors.numpy import load_file, save_file

from serving.safetensors import (
    FormatError,
    SafetensorsFile,
    StreamedTensor,
    dtype_code,
    write_renamed,
    write_safetensors,
)

ARRAYS = {
    "table": np.arange(70 * 3, dtype=np.float32).reshape(70, 3),
    "ids": np.arange(-5, 6, dtype=np.int64),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "mask": np.array([[True, False, True]]),
    "half": np.linspace(-1, 1, 9, dtype=np.float16).reshape(3, 3),
}


def streamed(name: str, array: np.ndarray, rows: int) -> StreamedTensor:
    """`array` offered `rows` rows at a time."""

    def chunks() -> Iterator[np.ndarray]:
        for start in range(0, max(len(array), 1), rows):
            yield array[start : start + rows]

    return StreamedTensor(name=name, dtype=dtype_code(array.dtype), shape=array.shape, chunks=chunks)


def test_the_library_reads_what_we_stream(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    size = write_safetensors(path, [streamed(n, a, rows=8) for n, a in ARRAYS.items()], {"format": "pt"})
    assert size == path.stat().st_size
    loaded = load_file(path)
    assert set(loaded) == set(ARRAYS)
    for name, array in ARRAYS.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array), name
    header_bytes = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + header_bytes) % 8 == 0, "the data starts 8-byte aligned"


def test_we_read_what_the_library_writes(tmp_path: Path) -> None:
    path = tmp_path / "theirs.safetensors"
    save_file(ARRAYS, str(path), metadata={"producer": "them"})
    ours = SafetensorsFile(path)
    assert set(ours.names) == set(ARRAYS) and ours.metadata == {"producer": "them"}
    for name, array in ARRAYS.items():
        got = ours.array(name)
        assert got.dtype == array.dtype and np.array_equal(got, array), name
        assert not got.flags.writeable


def test_chunks_that_do_not_make_the_shape_are_refused_and_leave_no_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    short = StreamedTensor(name="t", dtype="F32", shape=(10, 3), chunks=lambda: [np.zeros((9, 3), np.float32)])
    with pytest.raises(ValueError, match="its chunks hold 108 bytes, its shape 120"):
        write_safetensors(path, [short], {})
    wrong = StreamedTensor(name="t", dtype="F32", shape=(10, 3), chunks=lambda: [np.zeros((10, 3), np.float64)])
    with pytest.raises(ValueError, match="a chunk of float64"):
        write_safetensors(path, [wrong], {})
    assert os.listdir(tmp_path) == []


def test_a_failing_source_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(path, [streamed("t", ARRAYS["table"], rows=8)], {})
    before = path.read_bytes()

    def broken() -> Iterator[np.ndarray]:
        yield ARRAYS["table"][:8]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write_safetensors(path, [StreamedTensor(name="t", dtype="F32", shape=(70, 3), chunks=broken)], {})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["model.safetensors"]


def test_a_renamed_copy_holds_the_same_tensors_under_the_new_names(tmp_path: Path) -> None:
    source = tmp_path / "ours.safetensors"
    write_safetensors(source, [streamed(n, a, rows=8) for n, a in ARRAYS.items()], {})
    names = {name: f"renamed.{name}" for name in ARRAYS}
    size = write_renamed(SafetensorsFile(source), tmp_path / "theirs.safetensors", names, {"format": "pt"})
    loaded = load_file(tmp_path / "theirs.safetensors")
    assert size == (tmp_path / "theirs.safetensors").stat().st_size and sorted(loaded) == sorted(names.values())
    for name, array in ARRAYS.items():
        assert np.array_equal(loaded[names[name]], array), name
    with pytest.raises(ValueError, match="must cover every tensor once"):
        write_renamed(SafetensorsFile(source), tmp_path / "x.safetensors", {"table": "t"}, {})


def with_header(header: object, data: bytes = b"\0" * 12) -> bytes:
    body = orjson.dumps(header)
    return struct.pack("<Q", len(body)) + body + data


F32x3 = {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a safetensors file"),
        (struct.pack("<Q", 1 << 40) + b"{}", "not a safetensors file"),
        (struct.pack("<Q", 4) + b"{{{{", "not JSON"),
        (with_header([1, 2]), "not a JSON object"),
        (with_header({"x": {**F32x3, "dtype": "Q7"}}), "bad entry"),
        (with_header({"x": {**F32x3, "shape": [-3]}}), "bad entry|do not hold"),
        (with_header({"x": {**F32x3, "shape": [4]}}), "do not hold shape"),
        (with_header({"x": F32x3, "y": F32x3}, b"\0" * 24), "starts at byte 0, not 12"),
        (with_header({"x": F32x3}, b"\0" * 16), "cover 12 bytes of data, the file holds 16"),
        (with_header({"__metadata__": {"a": 1}, "x": F32x3}), "must map names to strings"),
    ],
    ids=["empty", "huge-header", "not-json", "not-object", "dtype", "negative", "size", "overlap", "trailing", "metadata"],
)
def test_a_malformed_file_is_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(FormatError, match=message) as err:
        SafetensorsFile(path)
    assert str(path) in err.value.message
