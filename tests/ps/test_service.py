"""A real PS (two shards) on loopback ports, over HTTP/2 and HTTP/1.1."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from common.errors import BadRequest, Conflict, TimedOut
from common.init import initial_rows
from common.keys import local_index, shard_of
from common.spec import Endpoint
from common.transport import Client, Request, connect_client
from common.wire import encode
from ps.client import PsClient
from ps.protocol import INCARNATION_HEADER, CheckpointReport, FetchRequest, Rows
from ps.store import Snapshot
from tests.ps.conftest import (
    DIM, LAYOUT, MAX_BODY, TOKEN, Cluster, make_server, make_service, raw_state, same_state, until,
)


def rows_for(keys: np.ndarray, value: float) -> tuple[np.ndarray, np.ndarray]:
    rows = np.tile(keys.astype(np.float32)[:, None] + value, (1, DIM))
    return rows, np.full((len(keys), 1), value, np.float32)


async def test_first_fetch_is_the_initial_rows(cluster: Cluster) -> None:
    keys = np.array([0, 1, 99, 100, 149], dtype=np.int64)
    got = await cluster.client.fetch(keys)
    assert np.array_equal(got.rows, initial_rows(LAYOUT, 3, keys, DIM))
    assert (got.state == np.float32(0.1)).all()
    assert (got.versions == -1).all()


async def test_concurrent_write_backs_and_fetches(cluster: Cluster) -> None:
    batches = [np.arange(i * 10, i * 10 + 10, dtype=np.int64) for i in range(15)]
    await asyncio.gather(*(cluster.client.write_back(k, *rows_for(k, 0.5), version=2) for k in batches))
    results = await asyncio.gather(*(cluster.client.fetch(k) for k in batches))
    for keys, got in zip(batches, results):
        want_rows, want_state = rows_for(keys, 0.5)
        assert np.array_equal(got.rows, want_rows)
        assert np.array_equal(got.state, want_state)
        assert (got.versions == 2).all()


async def test_fetch_waits_for_a_later_write_back(cluster: Cluster) -> None:
    keys = np.array([3, 4, 5], dtype=np.int64)
    fetch = asyncio.create_task(cluster.client.fetch(keys, np.array([-1, 7, 7])))
    await until(lambda: sum(s.fetches_waiting for s in cluster.services) == 2)
    assert not fetch.done()
    await cluster.client.write_back(keys[1:], *rows_for(keys[1:], 1.0), version=7)
    got = await asyncio.wait_for(fetch, 5)
    assert got.versions.tolist() == [-1, 7, 7]
    assert np.array_equal(got.rows[1:], rows_for(keys[1:], 1.0)[0])


async def test_a_restore_that_takes_rows_back_keeps_the_fetch_waiting(cluster: Cluster) -> None:
    keys = np.array([4, 6], dtype=np.int64)
    assert (shard_of(keys, 2) == 0).all()
    shard = cluster.services[0]
    fetch = asyncio.create_task(cluster.client.fetch(keys, np.array([7, 7])))
    await until(lambda: shard.fetches_waiting == 1)
    await cluster.client.write_back(keys[:1], *rows_for(keys[:1], 1.0), version=7)
    rows, state = rows_for(keys, 0.5)
    local = local_index(keys, 2)
    # Key 4 goes back to version 5 and key 6 comes to 7: the fetch must not be served yet.
    shard.restore_snapshot(Snapshot(local=local, rows=rows, state=state, versions=np.array([5, 7])), 5)
    await until(lambda: shard.fetches_waiting == 1)
    assert not fetch.done()
    await cluster.client.write_back(keys[:1], *rows_for(keys[:1], 2.0), version=7)
    got = await asyncio.wait_for(fetch, 5)
    assert got.versions.tolist() == [7, 7]
    assert np.array_equal(got.rows[0], rows_for(keys[:1], 2.0)[0][0])


async def test_a_fetch_that_cannot_be_served_times_out(cluster: Cluster) -> None:
    before = raw_state(cluster.services[0].store)
    with pytest.raises(TimedOut, match="did not reach their version"):
        await cluster.client.fetch(np.array([8], dtype=np.int64), np.array([1]), wait_s=0.2)
    assert all(not s.fetches_waiting for s in cluster.services)
    # Counting the rows behind initialised them (found by tests/ps/test_fuzz.py).
    assert same_state(before, raw_state(cluster.services[0].store)), "a refused fetch touched rows"
    await cluster.client.fetch(np.array([8], dtype=np.int64))  # still serving


async def test_stale_write_back_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    keys = np.array([10, 12], dtype=np.int64)
    await cluster.client.write_back(keys, *rows_for(keys, 2.0), version=5)
    with pytest.raises(Conflict, match="not newer"):
        await cluster.client.write_back(keys, *rows_for(keys, 9.0), version=5)
    got = await cluster.client.fetch(keys)
    assert np.array_equal(got.rows, rows_for(keys, 2.0)[0]) and (got.versions == 5).all()


async def test_checkpoint_then_restore_brings_back_the_rows(cluster: Cluster) -> None:
    keys = np.arange(0, 150, 7, dtype=np.int64)
    await cluster.client.write_back(keys, *rows_for(keys, 3.0), version=1)
    answers = await cluster.client.snapshot(1)
    assert [a.checkpoint for a in answers] == [1, 1] and all(a.nbytes > 0 for a in answers)
    await cluster.client.write_back(keys, *rows_for(keys, 4.0), version=2)
    await cluster.client.restore(1)
    got = await cluster.client.fetch(keys)
    assert np.array_equal(got.rows, rows_for(keys, 3.0)[0]) and (got.versions == 1).all()
    status = await cluster.client.status()
    assert [s.checkpoints for s in status] == [(1,), (1,)]
    assert [s.last_checkpoint for s in status] == [1, 1] and [s.max_version for s in status] == [1, 1]


async def test_metrics_count_rows_and_bytes(cluster: Cluster) -> None:
    keys = np.arange(20, dtype=np.int64)
    await cluster.client.fetch(keys)
    raw = connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=None)
    try:
        text = (await raw.call("GET", "/metrics")).decode()
    finally:
        await raw.close()
    assert 'bagpipe_rows_total{op="fetch"} 10' in text
    assert f'bagpipe_bytes_out_total{{op="fetch"}} {10 * (DIM + 1) * 4}' in text
    assert "bagpipe_rows_held 10" in text and f"bagpipe_table_rows {cluster.services[0].store.num_rows}" in text


def fetch_body(keys: list[int], **arrays: np.ndarray) -> bytes:
    return encode({}, {"keys": np.array(keys, dtype=np.int64), **arrays})


def write_body(
    version: object,
    keys: list[int],
    rows: np.ndarray | None = None,
    state: np.ndarray | None = None,
    *,
    write: object = "evict",
    replay: bool = False,
) -> bytes:
    n = len(keys)
    return encode(
        {"write": write, "version": version, "replay": replay},
        {
            "keys": np.array(keys, dtype=np.int64),
            "rows": np.zeros((n, DIM), np.float32) if rows is None else rows,
            "state": np.zeros((n, 1), np.float32) if state is None else state,
        },
    )


def wire_body(header: dict) -> bytes:
    """A wire body with this header and no payload (its arrays may lie about their size)."""
    head = orjson.dumps(header)
    return len(head).to_bytes(4, "little") + head + bytes(-(4 + len(head)) % 8)


BAD_REQUESTS = [
    ("POST", "/v1/fetch", b"\x01\x02", 400, "shorter than"),
    ("POST", "/v1/fetch", encode({}, {"keys": np.zeros(2, np.int32)}), 400, "int64"),
    ("POST", "/v1/fetch", encode({}, {"nokeys": np.zeros(2, np.int64)}), 400, "missing array"),
    ("POST", "/v1/fetch", fetch_body([0, 150]), 400, "outside"),
    ("POST", "/v1/fetch", fetch_body([1]), 400, "belongs to shard 1"),
    ("POST", "/v1/fetch", fetch_body([0, 2], min_versions=np.zeros(3, np.int64)), 400, "one entry per key"),
    ("POST", "/v1/fetch", encode({"wait_s": -1}, {"keys": np.zeros(1, np.int64)}), 400, "wait_s"),
    ("POST", "/v1/write_back", write_body("3", [0]), 400, "version must be an integer"),
    ("POST", "/v1/write_back", write_body(3, [0], rows=np.zeros((1, DIM + 1), np.float32)), 400, "rows must have shape"),
    ("POST", "/v1/write_back", write_body(3, [0], rows=np.zeros((1, DIM), np.float64)), 400, "float32"),
    ("POST", "/v1/write_back", write_body(3, [0, 0]), 400, "same key twice"),
    ("POST", "/v1/write_back", write_body(3, [2], rows=np.full((1, DIM), np.inf, np.float32)), 400, "finite"),
    # A row-wise Adagrad accumulator below 0: the trainer's sqrt of it was NaN.
    ("POST", "/v1/write_back", write_body(3, [2], state=np.full((1, 1), -5, np.float32)), 400, "state must be >= 0"),
    # Versions no run produces: they were a 500 after the rows had been overwritten.
    ("POST", "/v1/write_back", write_body(2**63, [0, 2]), 400, "version must be an integer in 0.."),
    ("POST", "/v1/write_back", write_body(2**64 - 1, [0, 2], replay=True), 400, "version must be an integer in 0.."),
    ("POST", "/v1/write_back", write_body(2**62, [0, 2], write="flush"), 400, "version must be an integer in 0.."),
    ("POST", "/v1/write_back", write_body(2.0**64, [0, 2]), 400, "version must be an integer"),  # JSON of 2**64
    ("POST", "/v1/fetch", encode({"wait_s": 2**63 - 1}, {"keys": np.zeros(1, np.int64)}), 400, "wait_s must be at most 5"),
    ("POST", "/v1/fetch", encode({"wait_s": 5.5}, {"keys": np.zeros(1, np.int64)}), 400, "wait_s must be at most 5"),
    ("POST", "/v1/fetch", fetch_body([0], min_versions=np.array([2**62])), 400, "min_versions must be at most"),
    ("POST", "/v1/fetch", wire_body({"arrays": [["keys", "<i8", [0, 2**63]]]}), 400, "too large"),
    ("POST", "/v1/fetch", wire_body({"arrays": [["keys", "<i8", [0] * 65]]}), 400, "at most 8"),
    ("POST", "/v1/checkpoint/snapshot", orjson.dumps({"checkpoint": 2**62}), 400, "checkpoint must be an integer in 0.."),
    ("POST", "/v1/checkpoint/report", orjson.dumps({"checkpoint": 2**63 - 1, "trainer": 0, "trainers": 1}), 400, "checkpoint must be"),
    ("POST", "/v1/restore", orjson.dumps({"checkpoint": 2**64 - 1}), 400, "checkpoint must be an integer in 0.."),
    ("POST", "/v1/checkpoint/report", b"{bad json", 400, "JSON"),
    ("POST", "/v1/checkpoint/report", orjson.dumps({"checkpoint": 4, "trainer": 2, "trainers": 2}), 400, "not below"),
    ("POST", "/v1/rejoined", orjson.dumps({"trainer": 2, "trainers": 2}), 400, "not below"),
    ("POST", "/v1/rejoined", orjson.dumps({"trainer": 0}), 400, "lacks ['trainers']"),
    ("POST", "/v1/checkpoint/snapshot", orjson.dumps({"checkpoint": -3}), 400, "non-negative"),
    ("POST", "/v1/restore", orjson.dumps({"checkpoint": 42}), 404, "no complete checkpoint"),
    ("POST", "/v1/checkpoint", orjson.dumps({"checkpoint": 1}), 404, ""),
    ("GET", "/v1/fetch", b"", 405, ""),
    ("POST", "/v1/nope", b"", 404, ""),
    ("POST", "/v1/fetch", bytes(MAX_BODY + 1), 413, ""),
    ("POST", "/v1/fetch", wire_body({"arrays": [["keys", "<i8", [0]], ["keys", "<i8", [0]]]}), 400, "declared twice"),
    ("POST", "/v1/fetch?wait=1&wait=2", fetch_body([0]), 400, "given twice"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "message"), BAD_REQUESTS)
async def test_bad_requests_get_4xx_and_nothing_changes(
    cluster: Cluster, method: str, path: str, body: bytes, status: int, message: str
) -> None:
    keys = np.array([0, 2], dtype=np.int64)
    await cluster.client.write_back(keys, *rows_for(keys, 1.0), version=1)
    raw = connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=TOKEN)
    try:
        answer = await raw.request(method, path, body=body)
        assert answer.status == status
        payload = orjson.loads(answer.body)
        assert message in payload["message"] and payload["error"]
        # the same connection and the server keep serving, and the data is intact
        ok = await raw.request("GET", "/v1/health")
        assert ok.status == 200
    finally:
        await raw.close()
    got = await cluster.client.fetch(keys)
    assert np.array_equal(got.rows, rows_for(keys, 1.0)[0]) and (got.versions == 1).all()


@pytest.mark.parametrize("write", [["evict"], {"evict": True}, 1, None])
async def test_a_write_kind_that_is_not_a_string_is_a_400_naming_the_field(
    cluster: Cluster, write: object
) -> None:
    """It was a 500 with a traceback: a list or an object cannot be looked up."""
    keys = np.array([0, 2], dtype=np.int64)
    await cluster.client.write_back(keys, *rows_for(keys, 1.0), version=1)
    raw = connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=TOKEN)
    try:
        answer = await raw.request("POST", "/v1/write_back", body=write_body(3, [0], write=write))
        payload = orjson.loads(answer.body)
        assert answer.status == 400 and payload["field"] == "write", payload
    finally:
        await raw.close()
    got = await cluster.client.fetch(keys)
    assert np.array_equal(got.rows, rows_for(keys, 1.0)[0]) and (got.versions == 1).all()


async def test_requests_without_the_token_are_refused(cluster: Cluster) -> None:
    for token in (None, "wrong"):
        raw = connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=token)
        try:
            answer = await raw.request("POST", "/v1/fetch", body=fetch_body([0]))
            assert answer.status == 401
            assert (await raw.request("GET", "/v1/health")).status == 200  # public
        finally:
            await raw.close()


async def test_public_health_shows_nothing_internal_and_reads_nothing(cluster: Cluster) -> None:
    """Anyone may ask health, as often as they like: it answers liveness and touches no
    data (it once scanned every version and listed the checkpoints on disk)."""

    class Untouchable:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"health read store.{name}")

    service = cluster.services[0]
    store, service.store = service.store, Untouchable()  # type: ignore[assignment]
    anonymous = connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=None)
    try:
        health = await anonymous.request("GET", "/v1/health")
        assert health.status == 200 and orjson.loads(health.body) == {"role": "ps", "ok": True}
        service.store = store
        assert (await anonymous.request("GET", "/v1/status")).status == 401
    finally:
        service.store = store
        await anonymous.close()
    status = await cluster.client.status()
    assert [s.incarnation for s in status] == [s.incarnation for s in cluster.services]


async def test_a_write_ack_counts_the_rows_really_written(cluster: Cluster) -> None:
    raw = connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=TOKEN)
    keys = [0, 2, 4, 6]

    async def written(version: int, replay: bool) -> int:
        return orjson.loads(await raw.call("POST", "/v1/write_back", body=write_body(version, keys, replay=replay)))["written"]

    try:
        assert await written(5, replay=False) == 4
        assert await written(5, replay=True) == 0  # landed already
        assert await written(3, replay=True) == 0  # older than the table's rows
        assert await written(7, replay=True) == 4
    finally:
        await raw.close()


async def test_client_errors_carry_the_server_message(cluster: Cluster) -> None:
    with pytest.raises(BadRequest, match="outside"):
        await cluster.client.fetch(np.array([500], dtype=np.int64))


# --------------------------------------------------------------------------- restarted alone
TRAINERS = 3


@pytest.fixture(params=["h2", "http1"])
async def rejoined(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Cluster]:
    """One shard (0 of 1) started as `--rejoin` starts it, for a job of TRAINERS trainers; its
    client is a tool's (it reports nothing)."""
    kind = request.param
    service = make_service(0, 1, tmp_path, rejoin_trainers=TRAINERS)
    server = make_server(kind, service)
    await server.start()
    client = PsClient([Endpoint(host="127.0.0.1", port=server.port)], token=TOKEN, dim=DIM, state_width=1,
                      transport=kind, timeout_s=10, retries=1, backoff_s=0.05)
    yield Cluster([service], [server], client, kind)
    await client.close()
    await server.stop()


async def report(raw: Client, trainer: int, trainers: int = TRAINERS) -> dict[str, Any]:
    body = orjson.dumps({"trainer": trainer, "trainers": trainers})
    return orjson.loads(await raw.call("POST", "/v1/rejoined", body=body))


def raw_client(cluster: Cluster) -> Client:
    return connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=TOKEN)  # type: ignore[return-value]


async def scrape(cluster: Cluster) -> str:
    raw = connect_client(cluster.transport, "127.0.0.1", cluster.servers[0].port, token=None)
    try:
        return (await raw.call("GET", "/metrics")).decode()
    finally:
        await raw.close()


def fetch_now(cluster: Cluster, keys: np.ndarray) -> object:
    """What the fetch handler returns for `keys` at any version: Rows when it answers at once
    (the transport then needs no task), an awaitable otherwise."""
    request = Request(method="POST", path="/v1/fetch", query={}, headers={}, body=b"")
    message = FetchRequest(keys=keys, min_versions=np.full(len(keys), -1, np.int64))
    return cluster.services[0].fetch(message, request)


async def test_a_shard_restarted_alone_holds_fetches_until_every_trainer_reported(
    rejoined: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Even a fetch for any version waits: the snapshot may lack a row whose newest write-back
    is in a journal not yet replayed. Once all trainers reported, it is served at once; a
    fetch for a version still waits for that version, within what is left of its wait."""
    caplog.set_level(logging.INFO, logger="ps.service")
    shard = rejoined.services[0]
    keys = np.array([3, 4], dtype=np.int64)
    held = fetch_now(rejoined, keys)
    assert not isinstance(held, Rows)
    held.close()  # type: ignore[attr-defined]  # a coroutine never started
    any_version = asyncio.create_task(rejoined.client.fetch(keys))
    versioned = asyncio.create_task(rejoined.client.fetch(keys, np.array([-1, 7])))
    await until(lambda: shard.fetches_waiting == 2)
    assert 'bagpipe_rejoin_trainers_waiting 3' in await scrape(rejoined)
    raw = raw_client(rejoined)
    try:
        assert await report(raw, 0) == {"reported": 1, "waiting": 2}
        assert await report(raw, 2) == {"reported": 2, "waiting": 1}
        assert await report(raw, 2) == {"reported": 2, "waiting": 1}  # a repeat changes nothing
        _, pending = await asyncio.wait({any_version, versioned}, timeout=0.2)
        assert pending == {any_version, versioned} and shard.fetches_waiting == 2
        assert (await rejoined.client.status())[0].rejoin_waits_for == (1,)
        assert await report(raw, 1) == {"reported": 3, "waiting": 0}
        got = await asyncio.wait_for(any_version, 5)
        assert got.versions.tolist() == [-1, -1]
        await until(lambda: shard.fetches_waiting == 1)  # now waiting for version 7 of key 4
        assert not versioned.done()
        await rejoined.client.write_back(keys[1:], *rows_for(keys[1:], 1.0), version=7)
        assert (await asyncio.wait_for(versioned, 5)).versions.tolist() == [-1, 7]
        assert await report(raw, 1) == {"reported": 3, "waiting": 0}  # late: still answered
    finally:
        await raw.close()
    assert isinstance(fetch_now(rejoined, keys), Rows)  # the fast path again: no task
    assert (await rejoined.client.status())[0].rejoin_waits_for == ()
    metrics = await scrape(rejoined)
    assert 'bagpipe_rejoin_trainers_waiting 0' in metrics
    assert 'bagpipe_fetch_held_seconds_count 2' in metrics  # the two fetches held above
    opened = [r for r in caplog.records if "every trainer (3) has replayed" in r.getMessage()]
    assert len(opened) == 1 and opened[0].levelno == logging.INFO


async def test_a_shard_restarted_alone_snapshots_only_once_every_trainer_reported(rejoined: Cluster) -> None:
    """A snapshot (the run's final tables) must hold every trainer's replayed write-backs."""
    raw = raw_client(rejoined)
    try:
        snapshot = asyncio.create_task(rejoined.client.snapshot(1))
        for trainer in range(TRAINERS - 1):
            await report(raw, trainer)
        _, pending = await asyncio.wait({snapshot}, timeout=0.2)
        assert pending == {snapshot}
        await report(raw, TRAINERS - 1)
        saved = await asyncio.wait_for(snapshot, 10)
    finally:
        await raw.close()
    assert [a.checkpoint for a in saved] == [1]


async def test_a_held_fetch_times_out_naming_the_trainers_not_reported(rejoined: Cluster) -> None:
    shard = rejoined.services[0]
    keys = np.array([3], dtype=np.int64)
    raw = raw_client(rejoined)
    try:
        with pytest.raises(TimedOut, match="restarted alone: trainers 0, 1, 2 have not replayed their "
                                           r"write-backs within 0.2 s") as caught:
            await rejoined.client.fetch(keys, wait_s=0.2)
        assert caught.value.status == 504 and caught.value.fields["trainers_missing"] == [0, 1, 2]
        await report(raw, 0)
        await report(raw, 2)
        with pytest.raises(TimedOut, match="trainer 1 has not replayed their write-backs within 0.2 s"):
            await rejoined.client.fetch(keys, wait_s=0.2)
        assert shard.fetches_waiting == 0  # a fetch that gave up is forgotten
        assert await report(raw, 1) == {"reported": 3, "waiting": 0}  # still serving
    finally:
        await raw.close()
    assert (await rejoined.client.fetch(keys, wait_s=0.2)).versions.tolist() == [-1]


async def test_a_shard_not_restarted_alone_answers_at_once_and_accepts_a_report(cluster: Cluster) -> None:
    keys = np.array([0, 2], dtype=np.int64)  # shard 0's
    assert isinstance(fetch_now(cluster, keys), Rows)  # no task, no wait
    raw = raw_client(cluster)
    try:
        assert await report(raw, 1, trainers=2) == {"reported": 0, "waiting": 0}  # nothing to open
    finally:
        await raw.close()
    assert (await cluster.client.fetch(keys)).versions.tolist() == [-1, -1]
    assert [s.rejoin_waits_for for s in await cluster.client.status()] == [(), ()]
    assert 'bagpipe_rejoin_trainers_waiting 0' in await scrape(cluster)


BAD_REJOIN_REPORTS = [
    (orjson.dumps({"trainer": 3, "trainers": 3}), "trainer 3 is not below trainers = 3"),
    (orjson.dumps({"trainer": 0, "trainers": 2}), "trainers = 2, but PS shard 0's job has 3 trainers"),
    (orjson.dumps({"trainer": 3, "trainers": 4}), "trainers = 4, but PS shard 0's job has 3 trainers"),
    (orjson.dumps({"trainer": -1, "trainers": 3}), "trainer must be a non-negative integer"),
    (orjson.dumps({"trainer": "1", "trainers": 3}), "trainer must be a non-negative integer"),
    (orjson.dumps({"trainer": True, "trainers": 3}), "trainer must be a non-negative integer"),
    (orjson.dumps({"trainer": 1, "trainers": 3.0}), "trainers must be a non-negative integer"),
    (orjson.dumps({"trainers": 3}), "body lacks ['trainer']"),
    (orjson.dumps({"trainer": 1, "trainers": 3, "checkpoint": 4}), "unexpected fields ['checkpoint']"),
    (orjson.dumps([1, 3]), "body must be a JSON object"),
    (b"{bad json", "body is not valid JSON"),
]


@pytest.mark.parametrize(("body", "message"), BAD_REJOIN_REPORTS)
async def test_a_malformed_rejoin_report_gets_a_400_and_opens_nothing(
    rejoined: Cluster, body: bytes, message: str
) -> None:
    shard = rejoined.services[0]
    raw = raw_client(rejoined)
    try:
        answer = await raw.request("POST", "/v1/rejoined", body=body)
        assert answer.status == 400
        payload = orjson.loads(answer.body)
        assert message in payload["message"] and payload["error"], payload
        assert shard.rejoin_waits_for == (0, 1, 2)
        assert (await raw.request("GET", "/v1/health")).status == 200  # the same connection serves on
        assert await report(raw, 1) == {"reported": 1, "waiting": 2}
    finally:
        await raw.close()


async def test_a_rejoin_report_meant_for_an_earlier_process_is_refused(rejoined: Cluster) -> None:
    """A trainer replayed to the shard's previous process: this one has not got its rows."""
    shard = rejoined.services[0]
    raw = raw_client(rejoined)
    try:
        answer = await raw.request("POST", "/v1/rejoined", body=orjson.dumps({"trainer": 0, "trainers": TRAINERS}),
                                   headers={INCARNATION_HEADER: "0" * 16})
        assert answer.status == 409 and orjson.loads(answer.body)["error"] == "restarted"
        assert shard.rejoin_waits_for == (0, 1, 2)
        current = {INCARNATION_HEADER: shard.incarnation}
        answer = await raw.request("POST", "/v1/rejoined", body=orjson.dumps({"trainer": 0, "trainers": TRAINERS}),
                                   headers=current)
        assert answer.status == 200 and shard.rejoin_waits_for == (1, 2)
    finally:
        await raw.close()


async def test_curl_reads_health_over_http2_prior_knowledge(tmp_path) -> None:
    service = make_service(0, 1, tmp_path)
    server = make_server("h2", service)
    await server.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--http2-prior-knowledge", "-o", "-", "-w", "\n%{http_version} %{http_code}",
            f"http://127.0.0.1:{server.port}/v1/health",
            stdout=subprocess.PIPE,
        )
        out, _ = await proc.communicate()
    finally:
        await server.stop()
    body, _, status = out.decode().rpartition("\n")
    assert status == "2 200"
    assert orjson.loads(body)["role"] == "ps"


@pytest.mark.parametrize("trainers", [3, 2**63 - 1])
async def test_a_checkpoint_report_must_name_the_jobs_trainer_count(tmp_path: Path, trainers: int) -> None:
    """A report naming more trainers than the job has waited for ever; one naming fewer would
    snapshot before every trainer's writes had landed."""
    service = make_service(0, 1, tmp_path, num_trainers=2)
    report = CheckpointReport(checkpoint=4, trainer=0, trainers=trainers)
    with pytest.raises(BadRequest, match="job has 2 trainers") as refused:
        await asyncio.wait_for(service.report_checkpoint(report, _request()), 5)
    assert refused.value.fields["field"] == "trainers"
    assert 4 not in service._reports  # nothing waits


async def test_reports_that_disagree_on_the_trainer_count_complete_no_snapshot(tmp_path: Path) -> None:
    """Not told the job's count (a tool's shard), the first report of a checkpoint sets it."""
    service = make_service(0, 1, tmp_path)
    first = asyncio.create_task(service.report_checkpoint(
        CheckpointReport(checkpoint=4, trainer=0, trainers=3), _request()))
    await until(lambda: 4 in service._reports)  # the first report waits for the others
    with pytest.raises(BadRequest, match="earlier reports of this checkpoint name 3 trainers"):
        await service.report_checkpoint(CheckpointReport(checkpoint=4, trainer=1, trainers=2), _request())
    assert not first.done() and not list((tmp_path / "ps-0").glob("*"))
    first.cancel()


def _request() -> Request:
    return Request(method="POST", path="/v1/checkpoint/report", query={}, headers={}, body=b"")
