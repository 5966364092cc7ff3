"""The oracle's protocol as pure logic, and its route table held to what is served and asked:
every message survives its codec with the bytes the oracle has always exchanged; every
malformed field is refused, naming it; both servers register exactly the table's routes;
every client asks only for them (a fake oracle made from the table alone serves them all)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from common.errors import BadRequest, Regrouped, Unavailable, WireError
from common.job import DataFacts
from common.spec import Endpoint
from common.steps import EndOfStream, EvalBatch
from common.transport import H2Server, Response, Router, StreamResponse, encode_message
from common.wire import encode
from oracle.coordinator_client import CoordinatorClient
from oracle.protocol import (
    ACKNOWLEDGE,
    COMPLETE_CHECKPOINT,
    COORDINATOR_ROUTES,
    DENSE,
    EVAL,
    FINISHED,
    HEALTH,
    INGEST,
    METRICS,
    PRESENCE,
    REGISTER,
    RESUME_POINT,
    ROUTES,
    SERVICE_ROUTES,
    STOP,
    STREAM,
    CheckpointCompleted,
    DenseCheckpoint,
    DenseRequest,
    EvalRequest,
    Finished,
    FinishProgress,
    IngestReceipt,
    Joined,
    OracleHealth,
    Presence,
    PresenceAnswer,
    Registration,
    ResumePoint,
    Route,
    StreamAck,
    StreamRequest,
    add_handlers,
)
from oracle.service import OracleService
from tests.common.test_steps import _step
from tests.oracle.test_coordinator import _coordinator
from tests.oracle.test_service import config, workload
from trainer.io_thread import IoThread
from trainer.remote import DirectiveStream, OracleLink, eval_batches, report_finished

ROOT = Path(__file__).resolve().parents[2]
A, B = Endpoint(host="10.0.0.2", port=7000), Endpoint(host="10.0.0.3", port=7001)
FACTS = DataFacts(table_sizes=(3, 4), num_dense=2, iterations=9)


def joined(**changes: Any) -> Joined:
    fields = dict(index=1, document={"name": "x", "ps": {"shards": 2}}, facts=FACTS, ps=(A, B),
                  store=Endpoint(host="10.0.0.1", port=29500), generation=2, resumed_from=4)
    return Joined(**{**fields, **changes})


def dense_checkpoint() -> DenseCheckpoint:
    return DenseCheckpoint(checkpoint=4, dense=b"\x80\x02torch", nbytes=1024, seconds=0.25)


# --------------------------------------------------------------------------- codec
#: Each message and the bytes the oracle and its clients exchanged before this module.
JSON_MESSAGES = [
    (Registration(role="ps", index=0, address=A), b'{"role":"ps","index":0,"address":"10.0.0.2:7000","fingerprint":null}'),
    (Registration(role="trainer", index=None, address=Endpoint(host="::1", port=0), fingerprint="ab"),
     b'{"role":"trainer","index":null,"address":"::1:0","fingerprint":"ab"}'),
    (joined(), orjson.dumps({
        "index": 1, "document": {"name": "x", "ps": {"shards": 2}},
        "facts": {"table_sizes": [3, 4], "num_dense": 2, "iterations": 9},
        "ps": ["10.0.0.2:7000", "10.0.0.3:7001"], "store": "10.0.0.1:29500", "generation": 2, "resumed_from": 4,
    })),
    (joined(ps=(), store=None, resumed_from=None), orjson.dumps({
        "index": 1, "document": {"name": "x", "ps": {"shards": 2}},
        "facts": {"table_sizes": [3, 4], "num_dense": 2, "iterations": 9},
        "ps": [], "store": None, "generation": 2, "resumed_from": None,
    })),
    (Finished(trainer=1), b'{"trainer":1}'),
    (FinishProgress(finished=2), b'{"finished":2}'),
    (CheckpointCompleted(checkpoint=4, kept=(0, 4)), b'{"checkpoint":4,"kept":[0,4]}'),
    (ResumePoint(resumed_from=None), b'{"resumed_from":null}'),
    (ResumePoint(resumed_from=9), b'{"resumed_from":9}'),
    (OracleHealth(role="oracle", mode="bagpipe", trainers=2, iterations=32, planned=5),
     b'{"role":"oracle","mode":"bagpipe","trainers":2,"iterations":32,"planned":5}'),
]


@pytest.mark.parametrize(("message", "wire"), JSON_MESSAGES, ids=lambda m: type(m).__name__)
def test_each_json_message_round_trips_with_the_bytes_it_always_had(message: Any, wire: bytes) -> None:
    assert message.to_wire() == wire
    assert type(message).from_wire(wire) == message


def test_the_dense_checkpoint_round_trips_with_the_bytes_it_always_had() -> None:
    done = dense_checkpoint()
    wire = encode({"checkpoint": 4, "bytes": 1024, "seconds": 0.25}, {"dense": np.frombuffer(b"\x80\x02torch", np.uint8)})
    assert done.to_wire() == wire
    back = DenseCheckpoint.from_wire(wire)
    assert (back.checkpoint, back.dense, back.nbytes, back.seconds) == (4, b"\x80\x02torch", 1024, 0.25)
    assert DenseCheckpoint.from_wire(encode({"checkpoint": 4, "bytes": 1, "seconds": 3},
                                            {"dense": np.zeros(0, np.uint8)})).seconds == 3.0  # an int is a number


@pytest.mark.parametrize(
    ("route", "message", "target"),
    [
        (STREAM, StreamRequest(trainer=1, start=5), "/v1/stream?trainer=1&start=5"),
        (ACKNOWLEDGE, StreamAck(trainer=0, next=6), "/v1/stream/ack?trainer=0&next=6"),
        (EVAL, EvalRequest(trainer=1), "/v1/eval?trainer=1"),
        (DENSE, DenseRequest(checkpoint=4), "/v1/dense?checkpoint=4"),
    ],
)
def test_each_query_message_is_the_target_it_always_was(route: Route, message: Any, target: str) -> None:
    assert route.target(message) == target
    assert type(message).from_wire(message.to_wire()) == message
    assert type(message).from_wire({**message.to_wire(), "other": "x"}) == message  # unknown: ignored


def test_a_target_takes_its_routes_message_only() -> None:
    assert REGISTER.target() == "/v1/register" and HEALTH.target() == "/v1/health"
    with pytest.raises(TypeError, match="takes a StreamRequest"):
        STREAM.target(StreamAck(trainer=0, next=0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes a StreamRequest"):
        STREAM.target()
    with pytest.raises(TypeError, match="takes no query parameters"):
        REGISTER.target(EvalRequest(trainer=0))


# --------------------------------------------------------------------------- malformed
def _json(cls: type, payload: dict[str, Any], field: str) -> Any:
    return pytest.param(cls, orjson.dumps(payload), field, id=f"{cls.__name__}-{field}-{len(payload)}")


REG = {"role": "ps", "index": 0, "address": "h:1"}
JOINED = orjson.loads(joined().to_wire())
MALFORMED = [
    _json(Registration, {"index": 0, "address": "h:1"}, "role"),
    _json(Registration, {**REG, "role": "oracle"}, "role"),
    _json(Registration, {**REG, "role": ["ps"]}, "role"),
    _json(Registration, {**REG, "index": -1}, "index"),
    _json(Registration, {**REG, "index": True}, "index"),
    _json(Registration, {**REG, "index": "0"}, "index"),
    _json(Registration, {"role": "ps", "index": 0}, "address"),
    _json(Registration, {**REG, "address": "nohost"}, "address"),
    _json(Registration, {**REG, "address": 5}, "address"),
    _json(Registration, {**REG, "address": "h:0"}, "address"),  # a PS serves on a port
    _json(Registration, {**REG, "fingerprint": 5}, "fingerprint"),
    *(_json(Joined, {k: v for k, v in JOINED.items() if k != name}, name)
      for name in ("index", "document", "facts", "ps", "store", "generation")),
    _json(Joined, {**JOINED, "index": -1}, "index"),
    _json(Joined, {**JOINED, "document": []}, "document"),
    _json(Joined, {**JOINED, "facts": [3, 4]}, "facts"),
    _json(Joined, {**JOINED, "facts": {**JOINED["facts"], "table_sizes": [3, 0]}}, "facts.table_sizes"),
    _json(Joined, {**JOINED, "facts": {**JOINED["facts"], "table_sizes": "34"}}, "facts.table_sizes"),
    _json(Joined, {**JOINED, "facts": {**JOINED["facts"], "num_dense": -1}}, "facts.num_dense"),
    _json(Joined, {**JOINED, "facts": {"table_sizes": [3], "num_dense": 1}}, "facts.iterations"),
    _json(Joined, {**JOINED, "ps": "10.0.0.2:7000"}, "ps"),
    _json(Joined, {**JOINED, "ps": ["10.0.0.2:7000", "nohost"]}, "ps"),
    _json(Joined, {**JOINED, "store": "x"}, "store"),
    _json(Joined, {**JOINED, "generation": True}, "generation"),
    _json(Joined, {**JOINED, "resumed_from": -1}, "resumed_from"),
    _json(Joined, {**JOINED, "resumed_from": "4"}, "resumed_from"),
    _json(Finished, {}, "trainer"),
    _json(Finished, {"trainer": "0"}, "trainer"),
    _json(Finished, {"trainer": -1}, "trainer"),
    _json(FinishProgress, {"finished": 1.5}, "finished"),
    _json(CheckpointCompleted, {"kept": []}, "checkpoint"),
    _json(CheckpointCompleted, {"checkpoint": 4, "kept": [1, "2"]}, "kept"),
    _json(CheckpointCompleted, {"checkpoint": 4, "kept": 4}, "kept"),
    _json(ResumePoint, {}, "resumed_from"),
    _json(ResumePoint, {"resumed_from": 4.0}, "resumed_from"),
    _json(OracleHealth, {"role": 5, "mode": "bagpipe", "trainers": 2, "iterations": 3, "planned": 0}, "role"),
    _json(OracleHealth, {"role": "oracle", "mode": "bagpipe", "trainers": 2, "iterations": 3, "planned": -1},
          "planned"),
]


@pytest.mark.parametrize(("cls", "body", "field"), MALFORMED)
def test_a_malformed_json_message_is_a_400_naming_its_field(cls: type, body: bytes, field: str) -> None:
    with pytest.raises(WireError) as caught:
        cls.from_wire(body)
    assert caught.value.fields == {"field": field} and caught.value.status == 400
    assert f"invalid {cls.NAME}: {field} " in caught.value.message  # type: ignore[attr-defined]


def test_a_key_given_twice_is_refused_naming_it() -> None:
    """orjson would keep the last: which trainer finished?"""
    with pytest.raises(WireError, match="finished report names the key 'trainer' twice") as caught:
        Finished.from_wire(b'{"trainer": 0, "trainer": 1}')
    assert caught.value.fields == {"field": "trainer"}
    with pytest.raises(WireError, match="names the key 'num_dense' twice"):
        Joined.from_wire(orjson.dumps(JOINED).replace(b'"num_dense":2', b'"num_dense":2,"num_dense":3'))


@pytest.mark.parametrize("cls", [Registration, Joined, Finished, CheckpointCompleted, ResumePoint, OracleHealth])
@pytest.mark.parametrize("body", [b"not json", b"[]", b'"registration"', b""])
def test_a_body_that_is_no_json_object_is_a_400_naming_the_message(cls: type, body: bytes) -> None:
    with pytest.raises(WireError, match=cls.NAME) as caught:  # type: ignore[attr-defined]
        cls.from_wire(body)
    assert caught.value.status == 400 and "field" not in caught.value.fields


def _dense(meta: dict[str, Any], dense: np.ndarray | None = None) -> bytes:
    return encode(meta, {} if dense is None else {"dense": dense})


DENSE_META = {"checkpoint": 4, "bytes": 10, "seconds": 0.5}
U8 = np.zeros(3, np.uint8)


@pytest.mark.parametrize(
    ("body", "key", "name"),
    [
        (_dense({"bytes": 10, "seconds": 0.5}, U8), "field", "checkpoint"),
        (_dense({**DENSE_META, "checkpoint": -1}, U8), "field", "checkpoint"),
        (_dense({**DENSE_META, "checkpoint": True}, U8), "field", "checkpoint"),
        (_dense({**DENSE_META, "bytes": "10"}, U8), "field", "bytes"),
        (_dense({"checkpoint": 4, "seconds": 0.5}, U8), "field", "bytes"),
        (_dense({**DENSE_META, "seconds": -1}, U8), "field", "seconds"),
        (_dense({**DENSE_META, "seconds": "0.5"}, U8), "field", "seconds"),
        (_dense(DENSE_META), "array", "dense"),
        (_dense(DENSE_META, np.zeros(3, np.int8)), "array", "dense"),
        (_dense(DENSE_META, np.zeros((1, 3), np.uint8)), "array", "dense"),
    ],
)
def test_a_malformed_dense_checkpoint_is_a_wire_error_naming_what(body: bytes, key: str, name: str) -> None:
    with pytest.raises(WireError) as caught:
        DenseCheckpoint.from_wire(body)
    assert caught.value.fields.get(key) == name and caught.value.status == 400


QUERIES = [(StreamRequest, {"trainer": "0", "start": "5"}), (StreamAck, {"trainer": "1", "next": "6"}),
           (EvalRequest, {"trainer": "1"}), (DenseRequest, {"checkpoint": "4"})]
BAD_VALUES = ["", "x", "-1", "+1", " 1", "1.0", "0x1", "\u00b2", "\u0661", "9" * 19, "1" * 4400]


@pytest.mark.parametrize(("cls", "query"), QUERIES, ids=lambda c: getattr(c, "__name__", ""))
def test_every_malformed_query_parameter_is_a_400_naming_it(cls: type, query: dict[str, str]) -> None:
    for name in query:
        cases = [{k: v for k, v in query.items() if k != name}] + [{**query, name: bad} for bad in BAD_VALUES]
        for case in cases:
            with pytest.raises(BadRequest) as caught:
                cls.from_wire(case)
            assert type(caught.value) is BadRequest and caught.value.fields == {"parameter": name}, case
            assert repr(name) in caught.value.message and len(caught.value.message) < 200
    assert cls.from_wire({k: "0" + v for k, v in query.items()}) == cls.from_wire(query)  # '01' is 1, as before


def test_bounds_only_a_server_knows_are_checked_naming_the_parameter() -> None:
    ask = StreamRequest(trainer=1, start=5)
    assert ask.within(trainer=(0, 1), start=(5, 32)) is ask
    with pytest.raises(BadRequest, match=r"'trainer' must be an integer in 0\.\.0, got 1") as caught:
        ask.within(trainer=(0, 0), start=(0, 32))
    assert caught.value.fields == {"parameter": "trainer"}
    with pytest.raises(BadRequest, match=r"'start' must be an integer in 12\.\.32, got 5"):
        ask.within(trainer=(0, 1), start=(12, 32))


def test_messages_are_checked_when_built_too() -> None:
    with pytest.raises(WireError, match="invalid registration: role must be 'ps' or 'trainer'"):
        Registration(role="oracle", index=0, address=A)  # type: ignore[arg-type]
    with pytest.raises(WireError, match="address must be where the shard serves, not 10.0.0.2:0: port 0 is none"):
        Registration(role="ps", address=Endpoint(host="10.0.0.2", port=0))
    with pytest.raises(WireError, match="ps must be a tuple of Endpoints"):
        joined(ps=["10.0.0.2:7000"])
    with pytest.raises(WireError, match="dense must be bytes"):
        DenseCheckpoint(checkpoint=1, dense=bytearray(3), nbytes=3, seconds=0.0)  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="'trainer' must be a non-negative integer") as caught:
        StreamRequest(trainer=-1, start=0)
    assert caught.value.fields == {"parameter": "trainer"}


def test_a_refusal_quotes_at_most_a_few_hundred_bytes_of_what_it_was_sent() -> None:
    huge = "f" * (1 << 20)
    for cls, payload in [(Registration, {**REG, "fingerprint": 5, "index": huge}), (Registration, {**REG, "role": huge}),
                         (Joined, {**JOINED, "document": [huge]}), (Finished, {"trainer": huge})]:
        with pytest.raises(WireError) as caught:
            cls.from_wire(orjson.dumps(payload))
        assert len(caught.value.message) < 600
    with pytest.raises(BadRequest) as refused:
        StreamRequest.from_wire({"trainer": huge, "start": "0"})
    assert len(refused.value.message) < 200


# --------------------------------------------------------------------------- the route table
def test_the_table_names_each_route_once_and_only_health_and_metrics_are_public() -> None:
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES) == len(set(ROUTES))
    assert set(SERVICE_ROUTES).isdisjoint(COORDINATOR_ROUTES) and ROUTES == SERVICE_ROUTES + COORDINATOR_ROUTES
    assert {r.path for r in ROUTES if r.public} == {"/v1/health", "/metrics"}
    assert all(r.stream == () or r.response is None for r in ROUTES)  # a streamed answer is no one message


def test_each_server_registers_exactly_its_routes_of_the_table() -> None:
    """A route added by hand (not through the table) or dropped fails here."""
    service = OracleService(config(), workload(), max_ahead=4).router()
    coordinator = Router()
    _coordinator().add_routes(coordinator)
    for router, routes in ((service, SERVICE_ROUTES), (coordinator, COORDINATOR_ROUTES)):
        assert router.registered() == {(r.method, r.path) for r in routes}
        assert all(router.resolve(r.method, r.path).public == r.public for r in routes)


def _path_literals(path: Path) -> list[str]:
    """String constants of `path`'s code (docstrings have other words first) that are paths."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and (node.value.startswith("/v1/") or node.value.startswith("/metrics"))]


#: Files that may spell a route: the two protocols, and the trainer's own metrics target.
SPELL_ROUTES = {"oracle/protocol.py", "ps/protocol.py", "trainer/scrape.py"}


def test_no_role_spells_a_route_but_the_protocols() -> None:
    """Every client builds its requests from a route table (`Route.target`), every server
    registers from one: a path written by hand elsewhere fails here."""
    spelt = {}
    for folder in ("common", "oracle", "ps", "trainer", "launcher", "serving"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name not in SPELL_ROUTES and (found := _path_literals(path)):
                spelt[name] = found
    for name in ("launch.py",):
        if found := _path_literals(ROOT / name):
            spelt[name] = found
    assert spelt == {}


class FakeOracle:
    """An oracle made from the route table alone, each route answering what its messages
    allow; it records which route every request reached. A client that asks for a path
    not in the table gets 404 and fails."""

    def __init__(self, health_delay_s: float = 0.0) -> None:
        self.asked: list[tuple[Route, Any]] = []
        self.health_delay_s = health_delay_s  # > 0: a coordinator too busy to answer in time

    def router(self) -> Router:
        answers: dict[Route, Callable[[Any], Any]] = {
            STREAM: lambda ask: StreamResponse(chunks=self._steps(ask.start)),
            ACKNOWLEDGE: lambda ack: Response(status=204),
            HEALTH: self._health,
            METRICS: lambda _: Response(body=b"", content_type="text/plain"),
            REGISTER: lambda reg: joined(index=reg.index or 0, resumed_from=None),
            EVAL: lambda ask: StreamResponse(chunks=self._eval()),
            FINISHED: lambda done: FinishProgress(finished=1),
            COMPLETE_CHECKPOINT: lambda done: CheckpointCompleted(checkpoint=done.checkpoint, kept=(done.checkpoint,)),
            RESUME_POINT: lambda _: ResumePoint(resumed_from=4),
            DENSE: lambda ask: Response(body=b"dense state %d" % ask.checkpoint),
            PRESENCE: lambda seen: PresenceAnswer(term=seen.term + (seen.failure is not None), regroup=bool(seen.failure)),
            STOP: lambda _: Response(status=202),
            INGEST: lambda body: IngestReceipt(part="ingest-000000000000.tsv", rows=body.data.count(b"\n")),
        }
        assert set(answers) == set(ROUTES)
        router = Router()
        add_handlers(router, {route: self._recorded(route, answer) for route, answer in answers.items()})
        return router

    async def _health(self, _: Any) -> OracleHealth:
        await asyncio.sleep(self.health_delay_s)
        return OracleHealth(role="oracle", mode="bagpipe", trainers=1, iterations=2, planned=2)

    def _recorded(self, route: Route, answer: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def handler(message: Any) -> Any:
            self.asked.append((route, message))
            return answer(message)

        return handler

    async def _steps(self, start: int) -> AsyncIterator[bytes]:
        for x in range(start, 2):
            step = _step(x)
            yield encode_message(step.batch.to_wire()) + encode_message(step.directive.to_wire())
        yield encode_message(EndOfStream(iterations=2).to_wire())

    async def _eval(self) -> AsyncIterator[bytes]:
        batch = EvalBatch(keys=np.zeros((2, 1), np.int64), dense=np.zeros((2, 3), np.float32), labels=np.ones(2, np.float32))
        yield encode_message(batch.to_wire())
        yield encode_message(EndOfStream(iterations=1).to_wire())


@contextlib.contextmanager
def fake_oracle(health_delay_s: float = 0.0) -> Iterator[tuple[FakeOracle, IoThread, Endpoint]]:
    oracle, io = FakeOracle(health_delay_s), IoThread()
    server = H2Server(oracle.router(), host="127.0.0.1", port=0, token="t")
    io.run(server.start(), timeout=10)
    try:
        yield oracle, io, Endpoint(host="127.0.0.1", port=server.port)
    finally:
        io.run(server.stop(), timeout=10)
        io.close()


def test_a_coordinator_too_slow_to_answer_its_health_is_lost_only_after_reconnect_s() -> None:
    """Each health check times out (every_s * 2 = 0.1 s against 0.3 s): the watch counts
    that as unreachable, and says so once `reconnect_s` has passed, naming the field; a
    timeout never escapes as another error (under load it once did, and killed the role)."""
    with fake_oracle(health_delay_s=0.3) as (_, io, endpoint):
        coordinator = CoordinatorClient(endpoint, token="t")

        async def watch() -> None:
            try:
                await coordinator.watch(reconnect_s=0.5, every_s=0.05)
            finally:
                await coordinator.close()

        with pytest.raises(Unavailable, match=r"unreachable for 0.5 s \(cluster.reconnect_s\)"):
            io.run(watch(), timeout=30)


def test_every_client_asks_the_oracle_only_for_routes_of_the_table() -> None:
    with fake_oracle() as (oracle, io, endpoint):
        coordinator = CoordinatorClient(endpoint, token="t")

        async def coordinate() -> tuple[Any, ...]:
            answers = (
                await coordinator.join("ps", 1, A),
                await coordinator.complete_checkpoint(dense_checkpoint()),
                await coordinator.resumed_from(),
                await coordinator.dense_state(4),
                await coordinator.stop_stream(),
                await coordinator.ingest(b"1\t2\n0\t3\n"),
            )
            await coordinator.present(Presence(role="trainer", index=0, term=2))
            with pytest.raises(Regrouped, match="trainer 0's term 2 is over"):
                await coordinator.present(Presence(role="trainer", index=0, term=2, failure="a collective failed"))
            with contextlib.suppress(TimeoutError):  # it polls health for as long as it answers
                await asyncio.wait_for(coordinator.watch(reconnect_s=5, every_s=0.01), 0.5)
            await coordinator.close()
            return answers

        got, kept, resumed, dense, _, pushed = io.run(coordinate(), timeout=30)
        assert (got.index, kept, resumed, dense, pushed.rows) == (1, (4,), 4, b"dense state 4", 2)

        stream = DirectiveStream(io, endpoint, token="t", transport="h2", trainer=0, timeout_s=10)
        try:
            assert [s.iteration for s in stream] == [0, 1] and stream.iterations == 2
        finally:
            stream.close()
        link = OracleLink(endpoint=endpoint, token="t", transport="h2", timeout_s=10, retries=0, reconnect_s=0)
        assert len(list(eval_batches(io, link, 0))) == 1
        report_finished(io, link, 0)
    asked = {route for route, _ in oracle.asked}
    assert asked == set(ROUTES) - {METRICS}  # Prometheus, not a client of ours, reads the metrics
    messages = {route: message for route, message in oracle.asked}
    assert messages[REGISTER] == Registration(role="ps", index=1, address=A)
    assert messages[STREAM] == StreamRequest(trainer=0, start=0) and messages[EVAL] == EvalRequest(trainer=0)
    assert messages[FINISHED] == Finished(trainer=0) and messages[DENSE] == DenseRequest(checkpoint=4)
    assert StreamAck(trainer=0, next=2) in [m for r, m in oracle.asked if r == ACKNOWLEDGE]
