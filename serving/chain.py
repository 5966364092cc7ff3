"""Exports of a running job: a base, then deltas (docs/design.md#online-training).

A chain folder holds ``base-<c>/``, a full export of checkpoint c (`serving.export`), then
``delta-<c'>/`` for later checkpoints: ``delta.safetensors`` holds, per table, the rows that
changed since the link before (``embeddings.t<i>.index``: int64 row numbers within the
table, ascending; ``embeddings.t<i>.rows``: float32 [n, d]) and every dense parameter whole.
A row changed after checkpoint c exactly when its version in a later snapshot is above c
(every update reaches the PS by the next checkpoint, flushed or written back), so a delta
reads only the snapshots' version arrays and its own rows. ``chain.json`` lists the links in
order and is replaced atomically, last: a link is part of the chain only once it is whole.

`load_chain` applies the deltas to the base in order: the tables and dense parameters of the
last link, bit for bit those of a full export of its checkpoint (`serving.predict`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson

from common.checkpoints import dense_path, ps_dir
from common.files import write_atomically
from common.job import Job
from ps.checkpoint import snapshot_files
from serving.export import METADATA, export_model
from serving.manifest import dense_key, embedding_key
from serving.safetensors import FormatError, SafetensorsFile, StreamedTensor, dtype_code, write_safetensors
from serving.sources import dense_state, open_shard, open_checkpoint

CHAIN_FILE = "chain.json"
DELTA_FILE = "delta.safetensors"
FORMAT = "bagpipe-export-chain"


def index_key(table: int) -> str:
    return f"{embedding_key(table)}.index"


def rows_key(table: int) -> str:
    return f"{embedding_key(table)}.rows"


@dataclass(frozen=True, kw_only=True)
class Link:
    """One export of the chain: a base or a delta, of checkpoint `checkpoint`."""

    kind: str  # "base" | "delta"
    folder: str  # its folder's name, in the chain folder
    checkpoint: int
    exported_s: float  # time.time() once it was whole: where freshness ends
    rows: int  # rows it holds (a delta's changed rows)
    bytes: int


@dataclass(frozen=True)
class ExportChain:
    folder: Path
    links: tuple[Link, ...]

    @classmethod
    def read(cls, folder: Path) -> ExportChain:
        """The chain in `folder` (no links where there is none yet); FormatError if its file
        is not one."""
        path = folder / CHAIN_FILE
        if not path.is_file():
            return cls(folder, ())
        try:
            body = orjson.loads(path.read_bytes())
            if body.get("format") != FORMAT:
                raise FormatError(f"{path}: not a {FORMAT} file")
            return cls(folder, tuple(Link(**link) for link in body["links"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{path}: malformed: {exc}") from None

    def with_link(self, link: Link) -> ExportChain:
        chain = ExportChain(self.folder, (*self.links, link))
        write_atomically(self.folder / CHAIN_FILE, orjson.dumps({"format": FORMAT, "links": [asdict(x) for x in
                                                                                            chain.links]},
                                                                option=orjson.OPT_INDENT_2))
        return chain


def export_link(job: Job, checkpoint: int, folder: Path, *, chunk_rows: int) -> Link:
    """Checkpoint `checkpoint` (complete) as the chain in `folder`'s next link: its base if
    it has none, else a delta from its last link."""
    folder.mkdir(parents=True, exist_ok=True)
    chain = ExportChain.read(folder)
    if chain.links and checkpoint <= chain.links[-1].checkpoint:
        raise ValueError(f"checkpoint {checkpoint} is not after the chain's last link ({chain.links[-1].checkpoint})")
    if not chain.links:
        name = f"base-{checkpoint:010d}"
        result = export_model(open_checkpoint(job, checkpoint), folder / name, chunk_rows=chunk_rows)
        rows, size = sum(job.layout.sizes), sum(result.files.values())
        link = Link(kind="base", folder=name, checkpoint=checkpoint, exported_s=time.time(), rows=rows, bytes=size)
    else:
        name = f"delta-{checkpoint:010d}"
        rows, size = _write_delta(job, checkpoint, chain.links[-1].checkpoint, folder / name)
        link = Link(kind="delta", folder=name, checkpoint=checkpoint, exported_s=time.time(), rows=rows, bytes=size)
    chain.with_link(link)
    return link


def _write_delta(job: Job, checkpoint: int, after: int, out: Path) -> tuple[int, int]:
    """The rows of checkpoint `checkpoint` written after checkpoint `after`, and its dense
    state, into `out`/delta.safetensors; (rows, bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    dense = dense_state(job, dense_path(job.spec.checkpoint.dir, checkpoint), lambda saved: saved["model"])
    keys, rows = _changed(job, checkpoint, after)
    offsets = job.layout.offsets
    tensors = [_whole(dense_key(k), v.detach().cpu().contiguous().numpy()) for k, v in dense.items()]
    for t in range(job.layout.num_tables):
        a, b = np.searchsorted(keys, [offsets[t], offsets[t + 1]])
        tensors.append(_whole(index_key(t), keys[a:b] - offsets[t]))
        tensors.append(_whole(rows_key(t), rows[a:b]))
    size = write_safetensors(out / DELTA_FILE, tensors, METADATA | {"checkpoint": str(checkpoint),
                                                                    "after": str(after)})
    return len(keys), size


def _changed(job: Job, checkpoint: int, after: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys (ascending) and rows of every shard's snapshot of `checkpoint` whose version is
    above `after`."""
    num_shards = job.spec.ps.num_shards
    keys, rows = [], []
    for s in range(num_shards):
        open_shard(job, s, num_shards, checkpoint)  # its meta and shapes checked against the spec
        files = snapshot_files(ps_dir(job.spec.checkpoint.dir, s), checkpoint)
        versions = np.load(files["versions"], mmap_mode="r")
        changed = np.flatnonzero(versions > after)
        keys.append(np.load(files["local"], mmap_mode="r")[changed] * num_shards + s)
        rows.append(np.asarray(np.load(files["rows"], mmap_mode="r")[changed]))
    all_keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    order = np.argsort(all_keys, kind="stable")
    return all_keys[order], (np.concatenate(rows) if rows else np.zeros((0, job.dim), np.float32))[order]


def _whole(name: str, array: np.ndarray) -> StreamedTensor:
    array = np.ascontiguousarray(array)
    return StreamedTensor(name=name, dtype=dtype_code(array.dtype), shape=array.shape, chunks=lambda: (array,))


def deltas(chain: ExportChain) -> Iterator[tuple[Link, SafetensorsFile]]:
    """Each delta link of `chain`, in order, with its file."""
    for link in chain.links[1:]:
        if link.kind != "delta":
            raise FormatError(f"{chain.folder / CHAIN_FILE}: link {link.folder} after the first is not a delta")
        yield link, SafetensorsFile(chain.folder / link.folder / DELTA_FILE)
