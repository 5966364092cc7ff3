"""The messages of a directive stream: each iteration's data slice, its directive, the end.

The oracle sends, per trainer and iteration, a `batch` message (labels and dense features
of the trainer's slice) followed by the directive (`common.directive`), each framed by
`common.transport.encode_message`; after the last iteration an `end` message says how many
iterations the stream had. All three are `common.wire` bodies told apart by ``meta.kind``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from common.directive import Directive
from common.errors import WireError
from common.wire import decode, encode, require

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, eq=False)
class Step:
    """What trainer `directive.trainer` needs for iteration `directive.iteration`."""

    directive: Directive
    labels: np.ndarray  # float32 [B/T]
    dense: np.ndarray  # float32 [B/T, num_dense]

    @property
    def iteration(self) -> int:
        return self.directive.iteration

    def encode_batch(self) -> bytes:
        d = self.directive
        meta = {"kind": "batch", "iteration": d.iteration, "trainer": d.trainer}
        return encode(meta, {"labels": self.labels, "dense": self.dense})


def trainer_steps(directives: list[Directive], labels: np.ndarray, dense: np.ndarray) -> list[Step]:
    """One iteration's steps, one per trainer: its directive and its contiguous slice of the
    global batch (trainer j gets samples j*B/T .. (j+1)*B/T - 1)."""
    per = len(labels) // len(directives)
    return [
        Step(
            directive=d,
            labels=np.ascontiguousarray(labels[d.trainer * per : (d.trainer + 1) * per]),
            dense=np.ascontiguousarray(dense[d.trainer * per : (d.trainer + 1) * per]),
        )
        for d in directives
    ]


@dataclass(frozen=True, kw_only=True)
class EndOfStream:
    iterations: int

    def encode(self) -> bytes:
        return encode({"kind": "end", "iterations": self.iterations})


def decode_batch(body: bytes) -> tuple[int, np.ndarray, np.ndarray]:
    """(iteration, labels, dense) of a batch message; WireError if it is something else."""
    meta, arrays = decode(body)
    if meta.get("kind") != "batch" or type(meta.get("iteration")) is not int:
        raise WireError(f"expected a batch message, got kind {meta.get('kind')!r}")
    labels = require(arrays, "labels", "<f4", 1)
    dense = require(arrays, "dense", "<f4", 2)
    if dense.shape[0] != labels.shape[0]:
        raise WireError("dense and labels differ in length")
    return meta["iteration"], labels, dense


def kind_of(body: bytes) -> str:
    """`meta.kind` of a stream message, read without decoding its arrays twice."""
    meta, _ = decode(body)
    kind = meta.get("kind")
    if not isinstance(kind, str):
        raise WireError("stream message without a kind")
    return kind


def decode_end(body: bytes) -> EndOfStream:
    meta, _ = decode(body)
    if meta.get("kind") != "end" or type(meta.get("iterations")) is not int:
        raise WireError("malformed end-of-stream message")
    return EndOfStream(iterations=meta["iterations"])


@dataclass(frozen=True, kw_only=True, eq=False)
class EvalBatch:
    """One batch of a trainer's share of the held-out rows, as the oracle sends it
    (``GET /v1/eval``): the rows' global keys, dense features and labels."""

    keys: np.ndarray  # int64 [B, F]
    dense: np.ndarray  # float32 [B, num_dense]
    labels: np.ndarray  # float32 [B]

    def encode(self) -> bytes:
        arrays = {"keys": self.keys, "dense": self.dense, "labels": self.labels}
        return encode({"kind": "eval"}, {k: np.ascontiguousarray(v) for k, v in arrays.items()})

    @classmethod
    def decode(cls, body: bytes) -> EvalBatch:
        meta, arrays = decode(body)
        if meta.get("kind") != "eval":
            raise WireError(f"expected an eval message, got kind {meta.get('kind')!r}")
        batch = cls(keys=require(arrays, "keys", "<i8", 2), dense=require(arrays, "dense", "<f4", 2),
                    labels=require(arrays, "labels", "<f4", 1))
        if not len(batch.keys) == len(batch.dense) == len(batch.labels):
            raise WireError("eval keys, dense and labels differ in length")
        return batch


def held_out_share(batches: Iterable[T], rank: int, world: int) -> Iterator[T]:
    """Trainer `rank`'s share of the held-out batches: batches rank, rank + world, ... (the
    oracle sends each trainer its share). Rank 0 scores the predictions gathered rank by
    rank, so a re-scoring that wants the run's log loss to the last bit (a sum depends on
    its order) concatenates the shares in that order."""
    return itertools.islice(batches, rank, None, world)
