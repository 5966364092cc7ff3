"""The coordinator's bookkeeping and messages, who may join as what; its registration route
with real listeners on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from common.errors import BadRequest, Conflict
from common.job import DataFacts, Job, job_from_facts
from common.spec import Endpoint, parse_spec
from oracle.coordinator_service import Coordinator, Registry
from oracle.protocol import Joined, Registration, fingerprint

A, B = Endpoint(host="10.0.0.2", port=7000), Endpoint(host="10.0.0.3", port=7000)


def reg(role: str, index: int | None, address: Endpoint = A, fp: str | None = None) -> Registration:
    return Registration(role=role, index=index, address=address, fingerprint=fp)  # type: ignore[arg-type]


def registry() -> Registry:
    return Registry(num_shards=2, num_trainers=3, fingerprint="f00d")


def test_indices_are_the_callers_or_the_lowest_free() -> None:
    r = registry()
    assert r.register(reg("trainer", 1)) == (1, 0)
    assert r.register(reg("trainer", None)) == (0, 0)
    assert r.register(reg("trainer", None)) == (2, 0)
    with pytest.raises(Conflict, match="all 3 trainer indices have joined: give --index"):
        r.register(reg("trainer", None))
    assert r.register(reg("trainer", 1)) == (1, 1)  # a restart: the next generation


def test_an_index_outside_the_job_is_refused() -> None:
    with pytest.raises(BadRequest, match=r"ps index 2 is outside 0\.\.1"):
        registry().register(reg("ps", 2))


def test_a_ps_shard_comes_back_only_where_it_was() -> None:
    r = registry()
    r.register(reg("ps", 0, A))
    assert r.missing_ps == [1]
    assert r.register(reg("ps", 0, A)) == (0, 1)
    with pytest.raises(Conflict, match=r"registered at 10\.0\.0\.2:7000.*--bind 10\.0\.0\.2:7000"):
        r.register(reg("ps", 0, B))
    r.register(reg("ps", 1, B))
    assert r.missing_ps == [] and r.ps_addresses() == (A, B)


def test_a_role_with_another_jobs_spec_is_refused() -> None:
    r = registry()
    with pytest.raises(Conflict, match="belongs to another job"):
        r.register(reg("ps", 0, fp="beef"))
    assert r.missing_ps == [0, 1], "a refused registration changed nothing"
    assert r.register(reg("ps", 0, fp="f00d")) == (0, 0)


def test_the_fingerprint_is_of_the_content_not_its_spelling() -> None:
    assert fingerprint({"a": 1, "b": {"c": [1, 2]}}) == fingerprint({"b": {"c": [1, 2]}, "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"not json", None),
        (b"[]", None),
        (b'{"role": "oracle", "index": 0, "address": "h:1"}', "role"),
        (b'{"role": "ps", "index": -1, "address": "h:1"}', "index"),
        (b'{"role": "ps", "index": true, "address": "h:1"}', "index"),
        (b'{"role": "ps", "index": 0, "address": "nohost"}', "address"),
        ('{"role": "ps", "index": 0, "address": "h:\u00b2"}'.encode(), "address"),  # passes isdigit
        (b'{"role": "ps", "index": 0, "address": "h:' + b"9" * 5000 + b'"}', "address"),  # int() refuses
        (b'{"role": "ps", "index": 0, "address": "h:1", "fingerprint": 5}', "fingerprint"),
    ],
)
def test_a_malformed_registration_is_a_bad_request_naming_its_field(body: bytes, field: str | None) -> None:
    with pytest.raises(BadRequest) as caught:
        Registration.from_wire(body)
    assert caught.value.fields.get("field") == field


def test_messages_round_trip() -> None:
    r = reg("trainer", None, Endpoint(host="::1", port=0), fp="ab")
    assert Registration.from_wire(r.to_wire()) == r
    joined = Joined(index=1, document={"name": "x", "ps": {"shards": 2}},
                    facts=DataFacts(table_sizes=(3, 4), num_dense=2, iterations=9), ps=(A, B),
                    store=Endpoint(host="10.0.0.1", port=29500), generation=2)
    assert Joined.from_wire(joined.to_wire()) == joined
    with pytest.raises(BadRequest, match="invalid join answer: document is missing"):
        Joined.from_wire(b'{"index": 1}')


HUGE = "f" * (20 << 20)  # the probe's 20 MiB fingerprint


def test_a_refusal_quotes_at_most_a_few_hundred_bytes_of_what_it_was_sent() -> None:
    with pytest.raises(Conflict, match="belongs to another job") as refused:
        registry().register(reg("ps", 0, fp=HUGE))
    assert len(refused.value.message) < 600
    for body in ({"role": HUGE}, {"role": "ps", "index": HUGE},
                 {"role": "ps", "index": 0, "address": HUGE}, {"role": "ps", "index": 0, "address": HUGE + ":1"}):
        with pytest.raises(BadRequest) as caught:
            Registration.from_wire(orjson.dumps(body))
        assert len(caught.value.message) < 600, caught.value.message[:100]


# -- the coordinator's routes: a PS shard registers an address it listens on -----------------
def _job(num_shards: int) -> Job:
    document = {"ps": {"shards": num_shards}, "trainers": {"count": 1},
                "data": {"format": "synthetic", "rows": 64}, "model": {"name": "dlrm"}}
    facts = DataFacts(table_sizes=(10,), num_dense=1, iterations=4)
    return job_from_facts(parse_spec(document, Path("coordinated.toml")), facts)


def _coordinator(num_shards: int = 1) -> Coordinator:
    return Coordinator(_job(num_shards), start_store=lambda: (None, Endpoint(host="127.0.0.1", port=1)))


async def _register(coordinator: Coordinator, index: int | None, address: str) -> Joined:
    registration = Registration.from_wire(orjson.dumps({"role": "ps", "index": index, "address": address}))
    joined = await coordinator.register(registration)
    return Joined.from_wire(joined.to_wire())


async def _listener() -> asyncio.Server:
    return await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)


def _address(server: asyncio.Server) -> str:
    return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_ps_registers_only_an_address_it_listens_on() -> None:
    coordinator = _coordinator()
    with pytest.raises(BadRequest, match="port 0 is none") as refused:
        await _register(coordinator, None, "127.0.0.1:0")
    assert refused.value.fields["field"] == "address"
    gone = await _listener()
    dead = _address(gone)
    gone.close()
    await gone.wait_closed()
    with pytest.raises(BadRequest, match=f"nothing listens at {dead}"):
        await _register(coordinator, None, dead)
    assert coordinator.registry.missing_ps == [0], "a refused registration holds no index"
    live = await _listener()
    try:
        assert (await _register(coordinator, None, _address(live))).index == 0
    finally:
        live.close()


@pytest.mark.parametrize("index", [0, None])
async def test_a_dead_registration_gives_way_to_the_live_shard(index: int | None) -> None:
    """The probe's block: a registration whose shard is gone (here: it stopped listening)
    held index 0, and the real shard was told to come back at the dead one's address."""
    coordinator = _coordinator()
    first, second = await _listener(), await _listener()
    try:
        assert (await _register(coordinator, 0, _address(first))).index == 0
        first.close()
        await first.wait_closed()
        joined = await _register(coordinator, index, _address(second))
        assert joined.index == 0 and coordinator.registry.ps_addresses() == (Endpoint.parse(_address(second), "x"),)
    finally:
        second.close()


async def test_once_a_trainer_knows_the_shards_a_shard_comes_back_only_where_it_was() -> None:
    coordinator = _coordinator()
    first, second = await _listener(), await _listener()
    try:
        was = _address(first)
        await _register(coordinator, 0, was)
        assert await coordinator._wait_for_ps() == (Endpoint.parse(was, "x"),)
        first.close()
        await first.wait_closed()
        with pytest.raises(Conflict, match=f"--bind {was}"):
            await _register(coordinator, 0, _address(second))
    finally:
        second.close()
