"""The coordinator's bookkeeping and messages, without sockets: who may join as what."""

from __future__ import annotations

import orjson
import pytest

from common.coordinator import Joined, Registration, fingerprint
from common.errors import BadRequest, Conflict, WireError
from common.job import DataFacts
from common.spec import Endpoint
from oracle.coordinator import Registry

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
        Registration.from_json(body)
    assert caught.value.fields.get("field") == field


def test_messages_round_trip() -> None:
    r = reg("trainer", None, Endpoint(host="::1", port=0), fp="ab")
    assert Registration.from_json(r.to_json()) == r
    joined = Joined(index=1, document={"name": "x", "ps": {"shards": 2}},
                    facts=DataFacts(table_sizes=(3, 4), num_dense=2, iterations=9), ps=(A, B),
                    store=Endpoint(host="10.0.0.1", port=29500), generation=2)
    assert Joined.from_json(joined.to_json()) == joined
    with pytest.raises(WireError, match="malformed answer from the coordinator"):
        Joined.from_json(b'{"index": 1}')


HUGE = "f" * (20 << 20)  # the probe's 20 MiB fingerprint


def test_a_refusal_quotes_at_most_a_few_hundred_bytes_of_what_it_was_sent() -> None:
    with pytest.raises(Conflict, match="belongs to another job") as refused:
        registry().register(reg("ps", 0, fp=HUGE))
    assert len(refused.value.message) < 600
    for body in ({"role": HUGE}, {"role": "ps", "index": HUGE},
                 {"role": "ps", "index": 0, "address": HUGE}, {"role": "ps", "index": 0, "address": HUGE + ":1"}):
        with pytest.raises(BadRequest) as caught:
            Registration.from_json(orjson.dumps(body))
        assert len(caught.value.message) < 600, caught.value.message[:100]
