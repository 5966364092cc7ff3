"""The safetensors format, written a tensor chunk at a time and read lazily.

A file is an 8-byte little-endian header length N, N bytes of JSON (per tensor its
"dtype", "shape" and "data_offsets" [begin, end) into the bytes that follow, plus an
optional "__metadata__" map of strings), then every tensor's little-endian bytes in C order,
back to back, with no gap (https://github.com/huggingface/safetensors, "Format").

The library's `save_file` needs every tensor in memory, and an embedding table may be larger
than memory: `write_safetensors` lays the header out from the shapes alone, then copies each
tensor from an iterator of row chunks. `SafetensorsFile` reads the header and hands out
read-only memmaps, so a lookup of a few rows of a large table reads only their pages.
"""

from __future__ import annotations

import math
import mmap
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeGuard

import numpy as np
import orjson

from common.errors import BagpipeError, NotFound
from common.files import atomic_file

#: safetensors dtype codes and their little-endian numpy types (BF16 has none in numpy).
DTYPES: dict[str, np.dtype] = {
    code: np.dtype(name)
    for code, name in (("F64", "<f8"), ("F32", "<f4"), ("F16", "<f2"), ("I64", "<i8"), ("I32", "<i4"),
                       ("I16", "<i2"), ("I8", "i1"), ("U8", "u1"), ("BOOL", "?"))
}
DTYPES_BY_TYPE = {dtype: code for code, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the library's own limit: a larger length is a corrupt file
COPY_BYTES = 4 << 20
_METADATA = "__metadata__"


class FormatError(BagpipeError):
    """A file does not follow the format it should (safetensors, .npy); names the file."""

    code = "format"


@dataclass(frozen=True, kw_only=True)
class StreamedTensor:
    """A tensor to write: `chunks()` yields C-order arrays of dtype `dtype` whose
    concatenation along the first axis is the tensor, each small enough to hold in memory."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True, kw_only=True)
class _Entry:
    """Where one tensor lies in the data, and what it holds."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def dtype_code(dtype: np.dtype) -> str:
    """The safetensors code of a numpy dtype; ValueError for one the format lacks."""
    if dtype not in DTYPES_BY_TYPE:
        raise ValueError(f"safetensors has no dtype for {dtype}")
    return DTYPES_BY_TYPE[dtype]


def write_safetensors(path: Path, tensors: Sequence[StreamedTensor], metadata: dict[str, str]) -> int:
    """Write `tensors` to `path` atomically (all of it or the old file), streaming each one;
    returns the file's size. ValueError if a tensor's chunks do not add up to its shape."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names) or _METADATA in names:
        raise ValueError(f"tensor names must be unique and not {_METADATA!r}: {names}")
    head = _header(tensors, metadata)
    with atomic_file(path) as fh:
        fh.write(head)
        for tensor in tensors:
            _copy(fh, tensor)
    return len(head) + sum(t.nbytes for t in tensors)


def write_renamed(source: SafetensorsFile, path: Path, names: dict[str, str], metadata: dict[str, str]) -> int:
    """Write to `path` atomically the tensors of `source` under new names (``names[old]``, for
    every one of them): a new header, then the data copied byte for byte, `COPY_BYTES` at a
    time; returns the file's size."""
    if sorted(names) != sorted(source.names) or len(set(names.values())) != len(names):
        raise ValueError(f"{source.path}: the new names must cover every tensor once: {names}")
    head = _encode(metadata, {names[name]: source._entries[name] for name in source.names})
    with atomic_file(path) as out, open(source.path, "rb") as src:
        out.write(head)
        src.seek(source.data_start)
        shutil.copyfileobj(src, out, COPY_BYTES)
    return path.stat().st_size


def _header(tensors: Sequence[StreamedTensor], metadata: dict[str, str]) -> bytes:
    entries: dict[str, _Entry] = {}
    offset = 0
    for t in tensors:
        entries[t.name] = _Entry(dtype=DTYPES[t.dtype], shape=t.shape, begin=offset, end=offset + t.nbytes)
        offset += t.nbytes
    return _encode(metadata, entries)


def _encode(metadata: dict[str, str], entries: dict[str, _Entry]) -> bytes:
    body = orjson.dumps({
        _METADATA: metadata,
        **{name: {"dtype": DTYPES_BY_TYPE[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
           for name, e in entries.items()},
    })  # fmt: skip
    body += b" " * (-len(body) % 8)  # the format's padding: the data starts 8-byte aligned
    return struct.pack("<Q", len(body)) + body


def _copy(fh: BinaryIO, tensor: StreamedTensor) -> None:
    want, written = DTYPES[tensor.dtype], 0
    for chunk in tensor.chunks():
        if chunk.dtype != want or chunk.shape[1:] != tensor.shape[1:]:
            raise ValueError(f"{tensor.name}: a chunk of {chunk.dtype} {chunk.shape} in a tensor of "
                             f"{want} {tensor.shape}")
        fh.write(np.ascontiguousarray(chunk).data)
        written += chunk.nbytes
    if written != tensor.nbytes:
        raise ValueError(f"{tensor.name}: its chunks hold {written} bytes, its shape {tensor.nbytes}")


class SafetensorsFile:
    """A safetensors file: its tensors' names, dtypes and shapes, its metadata, and each
    tensor as a read-only memmap. The header is checked whole on opening (FormatError)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as fh:
                head = fh.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                    raise FormatError(f"{path}: not a safetensors file (header length {length}, file size {size})")
                header = orjson.loads(fh.read(length))
        except FileNotFoundError:
            raise NotFound(f"{path} does not exist") from None
        except orjson.JSONDecodeError as exc:
            raise FormatError(f"{path}: the safetensors header is not JSON: {exc}") from None
        self.data_start = 8 + length
        self.metadata, self._entries = _parse_header(path, header, size - self.data_start)
        self._map: mmap.mmap | None = None  # the whole file, mapped on first use

    @property
    def names(self) -> list[str]:
        """The tensors' names, in file order."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def array(self, name: str) -> np.ndarray:
        """Tensor `name`, mapped read-only: only the pages that are read come into memory."""
        e = self._entry(name)
        if e.end == e.begin:  # nothing to map
            empty = np.zeros(e.shape, e.dtype)
            empty.flags.writeable = False
            return empty
        if self._map is None:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            # Rows are looked up here and there: without this the kernel reads ahead around
            # every faulting row, and a few thousand lookups map most of a large table.
            self._map.madvise(mmap.MADV_RANDOM)
        flat = np.frombuffer(self._map, e.dtype, math.prod(e.shape), self.data_start + e.begin)
        return flat.reshape(e.shape)

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise NotFound(f"{self.path} holds no tensor {name!r}", tensor=name)
        return self._entries[name]


def _parse_header(path: Path, header: object, data_bytes: int) -> tuple[dict[str, str], dict[str, _Entry]]:
    """Metadata and entries in file order; FormatError unless the tensors tile the data."""
    if not isinstance(header, dict):
        raise FormatError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop(_METADATA, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{path}: {_METADATA} must map names to strings")
    entries = {name: _parse_entry(path, name, raw) for name, raw in header.items()}
    ordered = dict(sorted(entries.items(), key=lambda item: item[1].begin))
    end = 0
    for name, e in ordered.items():
        if e.begin != end:
            raise FormatError(f"{path}: tensor {name!r} starts at byte {e.begin}, not {end}: "
                              "the tensors must tile the data without gap or overlap")
        end = e.end
    if end != data_bytes:
        raise FormatError(f"{path}: the tensors cover {end} bytes of data, the file holds {data_bytes}")
    return metadata, ordered


def _parse_entry(path: Path, name: str, raw: object) -> _Entry:
    if not isinstance(raw, dict) or not _well_formed(raw):
        raise FormatError(f"{path}: tensor {name!r} has a bad entry {raw!r} (known dtypes: "
                          f"{', '.join(DTYPES)})")
    dtype, shape = DTYPES[raw["dtype"]], tuple(raw["shape"])
    begin, end = raw["data_offsets"]
    if min(shape, default=0) < 0 or begin < 0 or end - begin != math.prod(shape) * dtype.itemsize:
        raise FormatError(f"{path}: tensor {name!r}: offsets {begin}..{end} do not hold shape {shape} of {dtype}")
    return _Entry(dtype=dtype, shape=shape, begin=begin, end=end)


def _well_formed(raw: dict) -> bool:
    offsets = raw.get("data_offsets")
    return raw.get("dtype") in DTYPES and _ints(raw.get("shape")) and _ints(offsets) and len(offsets) == 2


def _ints(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int for v in value)
