"""Directive wire codec: round trip, canonical bytes, and WireError on malformed bodies."""

from __future__ import annotations

import numpy as np
import pytest

from common.directive import Directive
from common.errors import WireError
from common.wire import decode, encode


def make(**overrides: object) -> Directive:
    i32, i64 = np.int32, np.int64
    fields: dict[str, object] = dict(
        iteration=3,
        trainer=1,
        input_slots=np.array([[0, 1], [2, 0]], i32),
        prefetch_keys=np.array([7, 9], i64),
        prefetch_slots=np.array([4, 5], i32),
        prefetch_min_versions=np.array([-1, 2], i64),
        prefetch_targets=np.array([3, 5], i32),
        join_keys=np.array([11, 12], i64),
        join_send_slots=np.array([-1, 1], i32),
        join_recv_slots=np.array([3, -1], i32),
        sync_now_keys=np.array([7], i64),
        sync_now_slots=np.array([0], i32),
        sync_later_keys=np.array([8, 13], i64),
        sync_later_slots=np.array([-1, 2], i32),
        leave_slots=np.array([2], i32),
        write_keys=np.array([13], i64),
        write_slots=np.array([2], i32),
        write_flush=np.array([0], np.uint8),
        checkpoint=True,
    )
    fields.update(overrides)
    return Directive(**fields)  # type: ignore[arg-type]


def test_round_trip_is_exact() -> None:
    d = make()
    back = Directive.from_wire(d.to_wire())
    assert back.to_wire() == d.to_wire()
    assert (back.iteration, back.trainer, back.checkpoint) == (3, 1, True)
    for name in Directive.array_names():
        assert np.array_equal(getattr(back, name), getattr(d, name))
        assert getattr(back, name).dtype == getattr(d, name).dtype


@pytest.mark.parametrize(
    "overrides",
    [
        {"prefetch_slots": np.array([4], np.int32)},  # lengths differ
        {"join_keys": np.array([12, 11], np.int64)},  # not ascending
        {"join_keys": np.array([12, 12], np.int64)},  # not strictly
        {"sync_now_slots": np.array([-2], np.int32)},
        {"prefetch_targets": np.array([2, 5], np.int32)},  # before the iteration
        {"write_slots": np.array([2, 3], np.int32)},  # lengths differ
        {"write_flush": np.array([0, 1], np.uint8)},  # lengths differ
        {"write_flush": np.array([2], np.uint8)},  # a flag is 0 or 1
        {"input_slots": np.array([[0, -1], [2, 0]], np.int32)},
    ],
)
def test_inconsistent_directives_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(WireError):
        Directive.from_wire(make(**overrides).to_wire())


def test_malformed_bodies_raise_wire_error() -> None:
    body = make().to_wire()
    meta, arrays = decode(body)
    with pytest.raises(WireError):
        Directive.from_wire(body[:-8])
    with pytest.raises(WireError):
        Directive.from_wire(encode({**meta, "kind": "other"}, arrays))
    with pytest.raises(WireError):
        Directive.from_wire(encode({**meta, "iteration": -1}, arrays))
    with pytest.raises(WireError):
        Directive.from_wire(encode(meta, {**arrays, "leave_slots": arrays["leave_slots"].astype(np.int64)}))
    with pytest.raises(WireError):
        Directive.from_wire(encode(meta, {k: v for k, v in arrays.items() if k != "join_keys"}))
