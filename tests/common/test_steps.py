"""The stream messages as pure logic: each survives its codec with the bytes the oracle has
always sent, and a malformed one is refused with a WireError naming the field or array."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from common.directive import Directive
from common.errors import WireError
from common.steps import EndOfStream, EvalBatch, Step, TrainBatch, kind_of, trainer_steps
from common.wire import decode, encode


def directive(x: int, trainer: int = 0) -> Directive:
    """Trainer `trainer`'s directive of iteration `x`: two samples, one table, nothing to move."""
    i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    empty = {name: i64 if name in Directive._INT64 else i32 for name in (*Directive._INT32, *Directive._INT64)}
    return Directive(iteration=x, trainer=trainer, input_slots=np.zeros((2, 1), np.int32), **empty,
                     write_flush=np.zeros(0, np.uint8), checkpoint=False)


def _step(x: int) -> Step:
    return Step(directive=directive(x), labels=np.full(2, x, np.float32), dense=np.zeros((2, 3), np.float32))


def train_batch(n: int = 4) -> TrainBatch:
    return TrainBatch(iteration=7, trainer=1, labels=np.arange(n, dtype=np.float32),
                      dense=np.ones((n, 3), np.float32))


def eval_batch(n: int = 4) -> EvalBatch:
    return EvalBatch(keys=np.arange(n * 2, dtype=np.int64).reshape(n, 2), dense=np.zeros((n, 3), np.float32),
                     labels=np.ones(n, np.float32))


def test_each_message_round_trips_with_the_bytes_it_always_had() -> None:
    batch = train_batch()
    body = batch.to_wire()
    assert body == encode({"kind": "batch", "iteration": 7, "trainer": 1}, {"labels": batch.labels, "dense": batch.dense})
    back = TrainBatch.from_wire(body)
    assert (back.iteration, back.trainer) == (7, 1) and back.to_wire() == body
    assert EndOfStream(iterations=32).to_wire() == encode({"kind": "end", "iterations": 32})
    assert EndOfStream.from_wire(EndOfStream(iterations=32).to_wire()) == EndOfStream(iterations=32)
    held = eval_batch()
    assert held.to_wire() == encode({"kind": "eval"}, {"keys": held.keys, "dense": held.dense, "labels": held.labels})
    assert EvalBatch.from_wire(held.to_wire()).to_wire() == held.to_wire()
    assert [kind_of(m.to_wire()) for m in (batch, EndOfStream(iterations=0), held)] == ["batch", "end", "eval"]


def test_a_step_is_its_batch_then_its_directive() -> None:
    step = _step(3)
    batch = TrainBatch.from_wire(step.batch.to_wire())
    again = Step.of(batch, step.directive)
    assert again.iteration == 3 and np.array_equal(again.labels, step.labels)
    with pytest.raises(WireError, match="directive 3 arrived without its batch"):
        Step.of(None, step.directive)
    with pytest.raises(WireError, match="directive 4 arrived without its batch"):
        Step.of(batch, _step(4).directive)


def test_trainer_steps_cut_contiguous_slices() -> None:
    directives = [directive(0, 0), directive(0, 1)]
    steps = trainer_steps(directives, np.arange(4, dtype=np.float32), np.zeros((4, 3), np.float32))
    assert [s.labels.tolist() for s in steps] == [[0, 1], [2, 3]]
    assert [s.batch.trainer for s in steps] == [0, 1]


def _body(meta: dict[str, Any], **arrays: np.ndarray) -> bytes:
    return encode(meta, arrays)


LABELS, DENSE = np.zeros(2, np.float32), np.zeros((2, 3), np.float32)
KEYS = np.zeros((2, 1), np.int64)


@pytest.mark.parametrize(
    ("cls", "body", "named"),
    [
        (TrainBatch, _body({"kind": "end", "iteration": 0, "trainer": 0}, labels=LABELS, dense=DENSE), "kind"),
        (TrainBatch, _body({"iteration": 0, "trainer": 0}, labels=LABELS, dense=DENSE), "kind"),
        (TrainBatch, _body({"kind": "batch", "trainer": 0}, labels=LABELS, dense=DENSE), "iteration"),
        (TrainBatch, _body({"kind": "batch", "iteration": "1", "trainer": 0}, labels=LABELS, dense=DENSE), "iteration"),
        (TrainBatch, _body({"kind": "batch", "iteration": 1, "trainer": -1}, labels=LABELS, dense=DENSE), "trainer"),
        (TrainBatch, _body({"kind": "batch", "iteration": 1, "trainer": True}, labels=LABELS, dense=DENSE), "trainer"),
        (TrainBatch, _body({"kind": "batch", "iteration": 1, "trainer": 0}, dense=DENSE), "labels"),
        (TrainBatch, _body({"kind": "batch", "iteration": 1, "trainer": 0}, labels=LABELS.astype(np.float64),
                           dense=DENSE), "labels"),
        (TrainBatch, _body({"kind": "batch", "iteration": 1, "trainer": 0}, labels=LABELS, dense=DENSE[:1]), "dense"),
        (EndOfStream, _body({"kind": "end"}), "iterations"),
        (EndOfStream, _body({"kind": "end", "iterations": 2.0}), "iterations"),
        (EndOfStream, _body({"kind": "batch", "iterations": 2}), "kind"),
        (EvalBatch, _body({"kind": "eval"}, keys=KEYS, dense=DENSE), "labels"),
        (EvalBatch, _body({"kind": "eval"}, keys=KEYS.ravel(), dense=DENSE, labels=LABELS), "keys"),
        (EvalBatch, _body({"kind": "eval"}, keys=KEYS, dense=DENSE, labels=np.zeros(3, np.float32)), "labels"),
        (EvalBatch, _body({"kind": "batch"}, keys=KEYS, dense=DENSE, labels=LABELS), "kind"),
    ],
)
def test_a_malformed_message_is_a_wire_error_naming_what(cls: type, body: bytes, named: str) -> None:
    with pytest.raises(WireError) as caught:
        cls.from_wire(body)
    assert named in (caught.value.fields.get("field"), caught.value.fields.get("array")), caught.value
    assert caught.value.status == 400


def test_messages_are_checked_when_built_too() -> None:
    with pytest.raises(WireError, match="labels must be a numpy array"):
        TrainBatch(iteration=0, trainer=0, labels=[0.0], dense=DENSE[:1])  # type: ignore[arg-type]
    with pytest.raises(WireError, match="iterations must be a non-negative integer"):
        EndOfStream(iterations=-1)
    with pytest.raises(WireError, match="stream message without a kind") as caught:
        kind_of(_body({}))
    assert caught.value.fields["field"] == "kind"
    assert decode(eval_batch().to_wire())[0] == {"kind": "eval"}
