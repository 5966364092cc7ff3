"""The PS protocol as pure logic: every message survives its codec, and every malformed one
is refused with a WireError that names the problem."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import BadRequest, WireError
from common.wire import decode, encode
from ps.protocol import (
    ROUTES,
    CheckpointReport,
    CheckpointSaved,
    FetchRequest,
    Health,
    Rejoined,
    RejoinProgress,
    Restored,
    RestoreRequest,
    Rows,
    ShardStatus,
    SnapshotRequest,
    WriteAck,
    WriteBack,
    WriteKind,
)
from tests.ps.conftest import make_service

DIM = 3


def fetch_request(n: int = 3, wait_s: float | None = 2.5) -> FetchRequest:
    return FetchRequest(
        keys=np.arange(n, dtype=np.int64) * 7, min_versions=np.arange(n, dtype=np.int64) - 1, wait_s=wait_s
    )


def rows(n: int = 3) -> Rows:
    return Rows(
        rows=np.arange(n * DIM, dtype=np.float32).reshape(n, DIM),
        state=np.full((n, 1), 0.5, np.float32),
        versions=np.arange(n, dtype=np.int64),
    )


def write_back(n: int = 3, kind: WriteKind = WriteKind.EVICT, replay: bool = False) -> WriteBack:
    return WriteBack(
        kind=kind,
        version=9,
        keys=np.arange(n, dtype=np.int64),
        rows=np.ones((n, DIM), np.float32),
        state=np.zeros((n, 1), np.float32),
        replay=replay,
    )


def status() -> ShardStatus:
    return ShardStatus(shard=1, num_shards=2, rows=75, dim=DIM, incarnation="ab12", restored=4, max_version=7,
                       last_checkpoint=4, checkpoints=(4, 9))


CONTROL = [
    WriteAck(written=3, version=5),
    CheckpointReport(checkpoint=4, trainer=1, trainers=2),
    SnapshotRequest(checkpoint=4),
    CheckpointSaved(checkpoint=4, path="/tmp/ckpt/ps-0/4", nbytes=1024, seconds=0.25),
    RestoreRequest(checkpoint=9),
    Restored(checkpoint=9, rows=12),
    Health(role="ps", ok=True),
    status(),
    replace(status(), rejoin_waits_for=(0, 2)),
    Rejoined(trainer=1, trainers=2),
    RejoinProgress(reported=1, waiting=1),
]


def same_arrays(a: Any, b: Any) -> bool:
    """Field by field, arrays by value (array messages have no `==`)."""
    pairs = [(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)]
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in pairs)


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("message", CONTROL, ids=lambda m: type(m).__name__)
def test_control_messages_round_trip_as_one_json_object(message: Any) -> None:
    body = message.to_wire()
    assert orjson.loads(body) == {f.name: _json(getattr(message, f.name)) for f in fields(message)}
    assert type(message).from_wire(body) == message
    assert message.to_parts() == [body] and message.CONTENT_TYPE == "application/json"


def _json(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 40), wait_s=st.none() | st.floats(0.001, 1e4), seed=st.integers(0, 2**32 - 1))
def test_a_fetch_request_round_trips(n: int, wait_s: float | None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sent = FetchRequest(keys=rng.integers(0, 1 << 40, n), min_versions=rng.integers(-1, 100, n), wait_s=wait_s)
    got = FetchRequest.from_wire(sent.to_wire())
    assert same_arrays(got, sent)
    assert b"".join(sent.to_parts()) == sent.to_wire()


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 40), width=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_rows_round_trip_bit_for_bit(n: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sent = Rows(
        rows=rng.standard_normal((n, DIM), dtype=np.float32),
        state=rng.standard_normal((n, width), dtype=np.float32),
        versions=rng.integers(-1, 100, n),
    )
    assert same_arrays(Rows.from_wire(sent.to_wire()), sent)


@pytest.mark.parametrize("kind", list(WriteKind))
@pytest.mark.parametrize("replay", [False, True])
def test_a_write_back_round_trips_with_its_kind_and_replay_flag(kind: WriteKind, replay: bool) -> None:
    sent = write_back(kind=kind, replay=replay)
    meta, _ = decode(sent.to_wire())
    assert meta == {"write": kind.value, "version": 9, "replay": replay}
    assert same_arrays(WriteBack.from_wire(sent.to_wire()), sent)
    assert sent.nbytes == 3 * 8 + 3 * DIM * 4 + 3 * 4


def test_a_fetch_without_min_versions_or_wait_asks_for_any_version() -> None:
    got = FetchRequest.from_wire(encode({}, {"keys": np.array([3, 5], np.int64)}))
    assert got.min_versions.tolist() == [-1, -1] and got.wait_s is None


def test_status_checkpoints_arrive_as_a_tuple() -> None:
    assert ShardStatus.from_wire(status().to_wire()).checkpoints == (4, 9)


def test_a_status_without_rejoin_waits_for_waits_for_nobody() -> None:
    """Absent (an older shard), the list of trainers a restarted shard waits for is empty."""
    payload = orjson.loads(status().to_wire())
    del payload["rejoin_waits_for"]
    assert ShardStatus.from_wire(orjson.dumps(payload)).rejoin_waits_for == ()
    sent = replace(status(), rejoin_waits_for=[1, 3])  # a list, as JSON gives it
    assert sent.rejoin_waits_for == (1, 3) and ShardStatus.from_wire(sent.to_wire()) == sent


# --------------------------------------------------------------------------- refusals
def _fetch_body(meta: dict[str, Any] | None = None, **arrays: np.ndarray) -> bytes:
    return encode(meta or {}, {"keys": np.array([1, 2], np.int64), **arrays})


def _write_body(meta: dict[str, Any], **arrays: np.ndarray) -> bytes:
    parts = {"keys": np.array([1, 2], np.int64), "rows": np.zeros((2, DIM), np.float32),
             "state": np.zeros((2, 1), np.float32)}
    return encode(meta, {**parts, **arrays})


_WRITE_META = {"write": "evict", "version": 3, "replay": False}

BAD_BODIES = [
    (FetchRequest, b"\x00", "shorter than"),
    (FetchRequest, encode({}, {"nokeys": np.zeros(1, np.int64)}), "missing array 'keys'"),
    (FetchRequest, encode({}, {"keys": np.zeros(2, np.int32)}), "1-d int64"),
    (FetchRequest, encode({}, {"keys": np.zeros((2, 1), np.int64)}), "1-d int64"),
    (FetchRequest, _fetch_body(min_versions=np.zeros(3, np.int64)), "one entry per key"),
    (FetchRequest, _fetch_body(min_versions=np.zeros(2, np.float64)), "1-d int64"),
    (FetchRequest, _fetch_body(extra=np.zeros(2, np.int64)), "unexpected arrays ['extra']"),
    (FetchRequest, _fetch_body({"wait_s": 0}), "wait_s must be a positive number"),
    (FetchRequest, _fetch_body({"wait_s": "5"}), "wait_s must be a positive number"),
    (FetchRequest, _fetch_body({"wait_s": True}), "wait_s must be a positive number"),
    (FetchRequest, _fetch_body({"timeout_s": 5}), "unexpected meta fields ['timeout_s']"),
    (Rows, rows().to_wire()[:-8], "runs past the end"),
    (Rows, encode({}, {"rows": np.zeros((2, DIM), np.float32), "state": np.zeros((2, 1), np.float32),
                       "versions": np.zeros(3, np.int64)}), "rows has 2 rows for 3 versions"),
    (Rows, encode({}, {"rows": np.zeros((2, DIM), np.float64), "state": np.zeros((2, 1), np.float32),
                       "versions": np.zeros(2, np.int64)}), "2-d float32"),
    (Rows, encode({"x": 1}, {}), "unexpected meta fields ['x']"),
    (WriteBack, _write_body({"version": 3, "replay": False}), "lacks ['write']"),
    (WriteBack, _write_body({**_WRITE_META, "write": "replay"}), "write must be one of ['evict', 'flush']"),
    (WriteBack, _write_body({**_WRITE_META, "flush": True}), "unexpected meta fields ['flush']"),
    (WriteBack, _write_body({**_WRITE_META, "version": "3"}), "version must be an integer"),
    (WriteBack, _write_body({**_WRITE_META, "version": 3.0}), "version must be an integer"),
    (WriteBack, _write_body({**_WRITE_META, "replay": 1}), "replay must be a boolean"),
    (WriteBack, _write_body(_WRITE_META, rows=np.zeros((3, DIM), np.float32)), "rows has 3 rows for 2 keys"),
    (WriteBack, _write_body(_WRITE_META, state=np.zeros((1, 1), np.float32)), "state has 1 rows for 2 keys"),
    (WriteBack, _write_body(_WRITE_META, rows=np.zeros((2, DIM), np.float64)), "2-d float32"),
    (CheckpointReport, b"{bad json", "body is not valid JSON"),
    (CheckpointReport, b"[4]", "body must be a JSON object"),
    (CheckpointReport, b'{"checkpoint": 4, "checkpoint": 9, "trainer": 0, "trainers": 1}', "names the key 'checkpoint' twice"),
    (CheckpointReport, b'{"checkpoint": 4, "trainer": 0}', "body lacks ['trainers']"),
    (CheckpointReport, b'{"checkpoint": 4, "trainer": 0, "trainers": 1, "id": 4}', "unexpected fields ['id']"),
    (CheckpointReport, b'{"checkpoint": -1, "trainer": 0, "trainers": 1}', "checkpoint must be a non-negative"),
    (CheckpointReport, b'{"checkpoint": 4, "trainer": 2, "trainers": 2}', "trainer 2 is not below trainers = 2"),
    (CheckpointReport, b'{"checkpoint": 4.0, "trainer": 0, "trainers": 1}', "checkpoint must be a non-negative"),
    (SnapshotRequest, b'{"checkpoint": true}', "checkpoint must be a non-negative"),
    (RestoreRequest, b'{"checkpoint": "4"}', "checkpoint must be a non-negative"),
    (CheckpointSaved, b'{"checkpoint": 4, "path": 7, "nbytes": 1, "seconds": 0}', "path must be a string"),
    (CheckpointSaved, b'{"checkpoint": 4, "path": "p", "nbytes": 1, "seconds": -1}', "seconds must be a number >= 0"),
    (CheckpointSaved, b'{"checkpoint": 4, "path": "p", "nbytes": -1, "seconds": 0}', "nbytes must be a non-negative"),
    (Restored, b'{"checkpoint": 4, "rows": null}', "rows must be a non-negative"),
    (WriteAck, b'{"written": 2, "version": "5"}', "version must be an integer"),
    (ShardStatus, orjson.dumps({**orjson.loads(status().to_wire()), "checkpoints": [4, "9"]}), "checkpoints must be a list"),
    (ShardStatus, orjson.dumps({**orjson.loads(status().to_wire()), "incarnation": 12}), "incarnation must be a string"),
    (ShardStatus, orjson.dumps({**orjson.loads(status().to_wire()), "rejoin_waits_for": 1}), "rejoin_waits_for must be a list"),
    (ShardStatus, orjson.dumps({**orjson.loads(status().to_wire()), "rejoin_waits_for": [True]}), "rejoin_waits_for must be a list"),
    (Rejoined, b'{"trainer": 0}', "body lacks ['trainers']"),
    (Rejoined, b'{"trainers": 2}', "body lacks ['trainer']"),
    (Rejoined, b'{"trainer": 2, "trainers": 2}', "trainer 2 is not below trainers = 2"),
    (Rejoined, b'{"trainer": -1, "trainers": 2}', "trainer must be a non-negative integer"),
    (Rejoined, b'{"trainer": 0, "trainers": "2"}', "trainers must be a non-negative integer"),
    (Rejoined, b'{"trainer": false, "trainers": 2}', "trainer must be a non-negative integer"),
    (Rejoined, b'{"trainer": 0, "trainers": 2, "checkpoint": 4}', "unexpected fields ['checkpoint']"),
    (Rejoined, b'[0, 2]', "body must be a JSON object"),
    (RejoinProgress, b'{"reported": 1, "waiting": -1}', "waiting must be a non-negative integer"),
    (RejoinProgress, b'{"reported": 1.5, "waiting": 0}', "reported must be a non-negative integer"),
    (Health, b'{"role": "ps", "ok": 1}', "ok must be a boolean"),
    (Health, b'{"role": "ps", "ok": true, "incarnation": "ab12"}', "unexpected fields ['incarnation']"),
]


@pytest.mark.parametrize(("cls", "body", "message"), BAD_BODIES)
def test_a_malformed_body_is_a_wire_error_naming_the_problem(cls: Any, body: bytes, message: str) -> None:
    with pytest.raises(WireError) as caught:
        cls.from_wire(body)
    assert message in caught.value.message
    assert isinstance(caught.value, BadRequest) and caught.value.status == 400


def test_messages_are_checked_when_built_too() -> None:
    with pytest.raises(WireError, match="kind must be a WriteKind"):
        replace(write_back(), kind="evict")
    with pytest.raises(WireError, match="keys must be a numpy array"):
        FetchRequest(keys=[1, 2], min_versions=np.zeros(2, np.int64))  # type: ignore[arg-type]
    with pytest.raises(WireError, match="1-d int64"):
        FetchRequest(keys=np.zeros(2, np.int32), min_versions=np.zeros(2, np.int64))
    with pytest.raises(WireError, match="trainer 3 is not below trainers = 2"):
        CheckpointReport(checkpoint=4, trainer=3, trainers=2)
    with pytest.raises(WireError, match="invalid rejoin report: trainer 2 is not below trainers = 2"):
        Rejoined(trainer=2, trainers=2)


# --------------------------------------------------------------------------- routes
def test_the_route_table_is_what_a_shard_serves(tmp_path: Path) -> None:
    router = make_service(0, 1, tmp_path).router()
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)
    for route in ROUTES:
        assert router.resolve(route.method, route.path).public == route.public
    public = {r.path for r in ROUTES if r.public}
    assert public == {"/v1/health", "/metrics"}
    guarded = {r.path for r in ROUTES if r.incarnation}
    assert guarded == {"/v1/fetch", "/v1/write_back", "/v1/checkpoint/report", "/v1/checkpoint/snapshot", "/v1/rejoined"}


def test_a_refused_value_is_quoted_a_few_hundred_bytes_at_most() -> None:
    arrays = {"keys": np.zeros(1, np.int64), "rows": np.zeros((1, 2), np.float32),
              "state": np.zeros((1, 1), np.float32)}
    for meta in ({"write": "evict", "version": "9" * 1_000_000, "replay": False},
                 {"write": "evict", "version": 1, "replay": False, "x" * 1_000_000: 1}):
        with pytest.raises(WireError) as caught:
            WriteBack.from_wire(encode(meta, arrays))
        assert len(caught.value.message) < 600
