"""The messages of the oracle's two streams, each with its codec (`to_wire()` /
`from_wire()`, as every message of the project has).

The directive stream (``GET /v1/stream``) carries, per iteration, a `TrainBatch` (labels and
dense features of the trainer's slice) followed by the iteration's `Directive`
(`common.directive`); after the last iteration an `EndOfStream` says how many iterations
the stream had. The held-out stream (``GET /v1/eval``) carries `EvalBatch`es and an
`EndOfStream`. Each message is framed by `common.transport.encode_message`; all are
`common.wire` bodies told apart by ``meta.kind`` (`kind_of`). A message that does not follow
its definition raises `WireError` naming the field (meta) or the array. The routes are in
`oracle.protocol`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

import numpy as np

from common.directive import Directive
from common.errors import WireError, quoted
from common.wire import decode, encode, require

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, eq=False)
class TrainBatch:
    """Trainer `trainer`'s slice of the global batch of iteration `iteration` (``kind``
    "batch"): what its directive of that iteration trains on. Arrays make `==`
    meaningless, so it is disabled."""

    KIND: ClassVar[str] = "batch"

    iteration: int
    trainer: int
    labels: np.ndarray  # float32 [B/T]
    dense: np.ndarray  # float32 [B/T, num_dense]

    def __post_init__(self) -> None:
        _check_count(self.KIND, "iteration", self.iteration)
        _check_count(self.KIND, "trainer", self.trainer)
        _check_arrays(self.KIND, {"labels": self.labels, "dense": self.dense},
                      {"labels": ("<f4", 1), "dense": ("<f4", 2)})

    def to_wire(self) -> bytes:
        meta = {"kind": self.KIND, "iteration": self.iteration, "trainer": self.trainer}
        return encode(meta, {"labels": self.labels, "dense": self.dense})

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        meta, arrays = _decode(body, cls.KIND)
        return cls(iteration=meta.get("iteration"), trainer=meta.get("trainer"),
                   labels=require(arrays, "labels", "<f4", 1), dense=require(arrays, "dense", "<f4", 2))


@dataclass(frozen=True, kw_only=True, eq=False)
class Step:
    """What trainer `directive.trainer` needs for iteration `directive.iteration`: on the
    wire its `batch`, then its directive."""

    directive: Directive
    labels: np.ndarray  # float32 [B/T]
    dense: np.ndarray  # float32 [B/T, num_dense]

    @property
    def iteration(self) -> int:
        return self.directive.iteration

    @property
    def batch(self) -> TrainBatch:
        d = self.directive
        return TrainBatch(iteration=d.iteration, trainer=d.trainer, labels=self.labels, dense=self.dense)

    @classmethod
    def of(cls, batch: TrainBatch | None, directive: Directive) -> Self:
        """The step a stream's batch and the directive after it make; WireError unless the
        batch is that directive's."""
        if batch is None or (batch.iteration, batch.trainer) != (directive.iteration, directive.trainer):
            raise WireError(f"directive {directive.iteration} arrived without its batch")
        return cls(directive=directive, labels=batch.labels, dense=batch.dense)


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
    """The last message of a stream (``kind`` "end"): `iterations` steps (the directive
    stream: the run's length) or held-out batches (the held-out stream) were sent."""

    KIND: ClassVar[str] = "end"

    iterations: int

    def __post_init__(self) -> None:
        _check_count(self.KIND, "iterations", self.iterations)

    def to_wire(self) -> bytes:
        return encode({"kind": self.KIND, "iterations": self.iterations})

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        meta, _ = _decode(body, cls.KIND)
        return cls(iterations=meta.get("iterations"))


@dataclass(frozen=True, kw_only=True, eq=False)
class EvalBatch:
    """One batch of a trainer's share of the held-out rows, as the oracle sends it (``kind``
    "eval", ``GET /v1/eval``): the rows' global keys, dense features and labels."""

    KIND: ClassVar[str] = "eval"
    _ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {"keys": ("<i8", 2), "dense": ("<f4", 2), "labels": ("<f4", 1)}

    keys: np.ndarray  # int64 [B, F]
    dense: np.ndarray  # float32 [B, num_dense]
    labels: np.ndarray  # float32 [B]

    def __post_init__(self) -> None:
        _check_arrays(self.KIND, {name: getattr(self, name) for name in self._ARRAYS}, self._ARRAYS)

    def to_wire(self) -> bytes:
        arrays = {name: np.ascontiguousarray(getattr(self, name)) for name in self._ARRAYS}
        return encode({"kind": self.KIND}, arrays)

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        _, arrays = _decode(body, cls.KIND)
        return cls(**{name: require(arrays, name, dtype, ndim) for name, (dtype, ndim) in cls._ARRAYS.items()})


def kind_of(body: bytes | bytearray | memoryview) -> str:
    """`meta.kind` of a stream message, which says which class decodes it."""
    meta, _ = decode(body)
    kind = meta.get("kind")
    if not isinstance(kind, str):
        raise WireError("stream message without a kind", field="kind")
    return kind


def held_out_share(batches: Iterable[T], rank: int, world: int) -> Iterator[T]:
    """Trainer `rank`'s share of the held-out batches: batches rank, rank + world, ... (the
    oracle sends each trainer its share). Rank 0 scores the predictions gathered rank by
    rank, so a re-scoring that wants the run's log loss to the last bit (a sum depends on
    its order) concatenates the shares in that order."""
    return itertools.islice(batches, rank, None, world)


# --------------------------------------------------------------------------- checks
def _decode(body: bytes | bytearray | memoryview, kind: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Meta and arrays of a message that must be of `kind`."""
    meta, arrays = decode(body)
    if meta.get("kind") != kind:
        raise WireError(f"expected a {kind} message, got kind {quoted(meta.get('kind'))}", field="kind")
    return meta, arrays


def _check_count(kind: str, name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise WireError(f"invalid {kind} message: {name} must be a non-negative integer, got {quoted(value)}",
                        field=name)


def _check_arrays(kind: str, arrays: Mapping[str, object], specs: Mapping[str, tuple[str, int]]) -> None:
    """Each array a numpy array of its dtype and rank, all with as many rows as the first."""
    rows: dict[str, int] = {}
    for name, (dtype, ndim) in specs.items():
        value = arrays[name]
        if not isinstance(value, np.ndarray):
            raise WireError(f"invalid {kind} message: {name} must be a numpy array, got {type(value).__name__}",
                            array=name)
        rows[name] = len(require({name: value}, name, dtype, ndim))
    first, *others = rows
    for name in others:
        if rows[name] != rows[first]:
            raise WireError(f"invalid {kind} message: {name} has {rows[name]} rows for {rows[first]} {first}",
                            array=name)
