"""The oracle's protocol (docs/design.md#the-coordinator, #wire-format-and-transport): every
message its clients and its two servers exchange, and `ROUTES`, the one table of which
message goes where.

Two servers share the oracle's port: `oracle.service` (the directive streams, health,
metrics) and `oracle.coordinator_service` (registration, held-out rows, the end of the run,
checkpoints). Each registers its routes from this table (`add_handlers`), which decodes what
its handlers are asked and encodes what they answer; every client
(`oracle.coordinator_client`, `trainer.remote`) builds its requests from it
(`Route.target`, `ask`). `tests/oracle/test_protocol.py` fails on a route served or asked
for that is not in the table.

Messages are frozen keyword-only dataclasses, checked when they are built (on either side),
with one codec, `to_wire()` / `from_wire()`, in one of three forms:

* a JSON object (`Registration`, `Joined`, `Finished`, the answers): a body that does not
  follow its message, or names a key twice (`common.wire.peer_json`), raises `WireError`
  (400) naming the field, as in `ps.protocol`; fields a message does not know are ignored,
  as they always were;
* a `common.wire` body (`DenseCheckpoint`, and the streams' messages of `common.steps` and
  `common.directive`): `WireError` naming the field or the array;
* query parameters (`StreamRequest`, `StreamAck`, `EvalRequest`, `DenseRequest`):
  `to_wire()` gives them as strings, `from_wire()` takes them as the server received them
  (`Request.query`: the transport has refused a parameter given twice already). A
  malformed one raises `BadRequest` naming the ``parameter``; the bounds only a server
  knows (the trainers, the run's length) it checks with `_QueryMessage.within`.

What only the coordinator can judge (an index outside the job, a spec of another job, an
address taken) is checked by `oracle.coordinator_service`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, Self, get_args
from urllib.parse import urlencode

import numpy as np
import orjson

from common.directive import Directive
from common.errors import BadRequest, BagpipeError, WireError, clipped, quoted
from common.job import DataFacts, Job, job_from_facts
from common.spec import Endpoint, parse_spec
from common.steps import EndOfStream, EvalBatch, TrainBatch
from common.transport import Client, Request, Response, Router, StreamResponse, Then
from common.wire import decode, encode, peer_json, require

BINARY = "application/octet-stream"
JSON = "application/json"

Role = Literal["ps", "trainer"]
#: How long the oracle holds a trainer's registration waiting for the PS shards; the trainer
#: asks again until its `reconnect_s` runs out.
REGISTER_HOLD_S = 20.0


def fingerprint(document: Mapping[str, Any]) -> str:
    """A digest of a spec document: equal for the same TOML content however it is spelt."""
    return hashlib.sha256(orjson.dumps(document, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


class Message(Protocol):
    """What every message of the oracle's routes offers."""

    def to_wire(self) -> Any: ...

    @classmethod
    def from_wire(cls, wire: Any) -> Self: ...


# --------------------------------------------------------------------------- JSON bodies
@dataclass(frozen=True, kw_only=True)
class _JsonMessage:
    """One JSON object: the dataclass's fields in order, as `_to_json` writes them."""

    NAME: ClassVar[str]
    CONTENT_TYPE: ClassVar[str] = JSON
    #: Fields added later (an elastic job's): written only when they differ from their
    #: default, so that a message that does not use them has the bytes it always had.
    ADDED: ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> bytes:
        return orjson.dumps(self._to_json())

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        payload: Any = peer_json(body, cls.NAME)  # a key given twice is refused, as on the PS
        if not isinstance(payload, dict):
            raise WireError(f"{cls.NAME} must be a JSON object")
        return cls._from_json(payload)

    def _to_json(self) -> dict[str, Any]:
        return {f.name: self._field_to_json(f.name, getattr(self, f.name)) for f in fields(self)
                if f.name not in self.ADDED or getattr(self, f.name) != f.default}

    @classmethod
    def _from_json(cls, payload: dict[str, Any]) -> Self:
        """The message of a JSON object: a field it lacks takes its default, and is refused
        without one; the constructor checks the values."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in payload:
                values[f.name] = cls._field_from_json(f.name, payload[f.name])
            elif f.default is MISSING:
                raise WireError(f"invalid {cls.NAME}: {f.name} is missing", field=f.name)
        return cls(**values)

    def _field_to_json(self, name: str, value: Any) -> Any:
        """A field as JSON has it (most are as they are)."""
        return value

    @classmethod
    def _field_from_json(cls, name: str, raw: Any) -> Any:
        """A field from what JSON gave (most are as they are)."""
        return raw


@dataclass(frozen=True, kw_only=True)
class Registration(_JsonMessage):
    """A role joins the job (``POST /v1/register``): its index (None: the lowest free one),
    where it serves (a PS: the address it listens on; a trainer: its host, port 0), and the
    fingerprint of its own spec file when it has one, so that a role of another job is
    refused."""

    NAME: ClassVar[str] = "registration"
    ADDED: ClassVar[frozenset[str]] = frozenset({"last_term", "last_index", "nonce"})

    role: Role
    index: int | None = None
    address: Endpoint
    fingerprint: str | None = None
    # A trainer of an elastic job registering again after its job regrouped: the term it
    # left and its index there (its place in the next term goes by that index).
    last_term: int | None = None
    last_index: int | None = None
    # The same for every attempt of one process: a trainer that asks again while an elastic
    # job holds its registration is known as the one it held.
    nonce: str | None = None

    def __post_init__(self) -> None:
        _check_optional_count(self, "last_term")
        _check_optional_count(self, "last_index")
        nonce = self.nonce
        ok = nonce is None or (isinstance(nonce, str) and 0 < len(nonce) <= 64)
        _check(self, ok, "nonce", "must be a string of 1 to 64 characters or null, got %r", nonce)
        roles = get_args(Role)
        _check(self, self.role in roles, "role", "must be 'ps' or 'trainer', got %r", self.role)
        index = self.index
        ok = index is None or (type(index) is int and index >= 0)
        _check(self, ok, "index", "must be a non-negative integer or null, got %r", index)
        _check(self, isinstance(self.address, Endpoint), "address", "must be an Endpoint, got %r", self.address)
        _check(self, self.role != "ps" or self.address.port != 0, "address",
               "must be where the shard serves, not %s: port 0 is none", self.address)
        fp = self.fingerprint
        _check(self, fp is None or isinstance(fp, str), "fingerprint", "must be a string or null, got %r", fp)

    def _field_to_json(self, name: str, value: Any) -> Any:
        return str(value) if name == "address" else value

    @classmethod
    def _field_from_json(cls, name: str, raw: Any) -> Any:
        return _endpoint(cls, raw, name) if name == "address" else raw


@dataclass(frozen=True, kw_only=True)
class Joined(_JsonMessage):
    """The answer to a `Registration`: who this role is and everything it needs to run."""

    NAME: ClassVar[str] = "join answer"
    ADDED: ClassVar[frozenset[str]] = frozenset({"term"})

    index: int
    document: dict[str, Any]  # the spec, as the oracle parsed it from its TOML file
    facts: DataFacts
    ps: tuple[Endpoint, ...]  # every shard, in index order (trainers); empty for a PS
    store: Endpoint | None  # the trainers' rendezvous store (trainers)
    generation: int  # how many times this index joined before: a restart's fresh group key
    resumed_from: int | None = None  # the checkpoint this run resumed from (`--resume`)
    term: int = 0  # how many times the job regrouped before (`oracle.membership`)

    def __post_init__(self) -> None:
        _check_counts(self, "index", "generation", "term")
        _check(self, isinstance(self.document, dict), "document", "must be an object, got %r", self.document)
        _check(self, isinstance(self.facts, DataFacts), "facts", "must be DataFacts, got %r", self.facts)
        ps = self.ps
        ok = isinstance(ps, tuple) and all(isinstance(e, Endpoint) for e in ps)
        _check(self, ok, "ps", "must be a tuple of Endpoints, got %r", ps)
        _check(self, self.store is None or isinstance(self.store, Endpoint), "store",
               "must be an Endpoint or null, got %r", self.store)
        _check_optional_count(self, "resumed_from")

    def _field_to_json(self, name: str, value: Any) -> Any:
        if name == "facts":
            return {"table_sizes": list(value.table_sizes), "num_dense": value.num_dense,
                    "iterations": value.iterations}
        if name == "ps":
            return [str(e) for e in value]
        if name == "store":
            return None if value is None else str(value)
        return value

    @classmethod
    def _field_from_json(cls, name: str, raw: Any) -> Any:
        if name == "facts":
            return _facts(raw)
        if name == "ps":
            _check(cls, isinstance(raw, list), "ps", "must be a list of 'host:port', got %r", raw)
            return tuple(_endpoint(cls, e, "ps") for e in raw)
        if name == "store":
            return None if raw is None else _endpoint(cls, raw, "store")
        return raw

    def job(self, coordinator: Endpoint) -> Job:
        """The job, its spec rebuilt from the document; the data is never opened."""
        source = Path(f"coordinator-{coordinator.host}-{coordinator.port}.toml")
        return job_from_facts(parse_spec(self.document, source), self.facts)


@dataclass(frozen=True, kw_only=True)
class Presence(_JsonMessage):
    """A role of an elastic job is alive in term `term` (``POST /v1/presence``, about twice
    a second); `failure`: it cannot go on in that term (a trainer whose collective failed),
    which makes the job regroup at once."""

    NAME: ClassVar[str] = "presence"

    role: Role
    index: int
    term: int
    failure: str | None = None

    def __post_init__(self) -> None:
        _check(self, self.role in get_args(Role), "role", "must be 'ps' or 'trainer', got %r", self.role)
        _check_counts(self, "index", "term")
        _check(self, self.failure is None or isinstance(self.failure, str), "failure",
               "must be a string or null, got %r", self.failure)
        if self.failure is not None:
            object.__setattr__(self, "failure", clipped(self.failure))


@dataclass(frozen=True, kw_only=True)
class PresenceAnswer(_JsonMessage):
    """The coordinator's current term, and whether the role that asked must start again
    (its term is over, or the job is regrouping)."""

    NAME: ClassVar[str] = "presence answer"

    term: int
    regroup: bool

    def __post_init__(self) -> None:
        _check_counts(self, "term")
        _check(self, type(self.regroup) is bool, "regroup", "must be a boolean, got %r", self.regroup)


@dataclass(frozen=True, kw_only=True)
class Finished(_JsonMessage):
    """Trainer `trainer` is done (``POST /v1/finished``): once every trainer is, the oracle
    stops by itself."""

    NAME: ClassVar[str] = "finished report"

    trainer: int

    def __post_init__(self) -> None:
        _check_counts(self, "trainer")


@dataclass(frozen=True, kw_only=True)
class FinishProgress(_JsonMessage):
    """The answer to a `Finished`: how many trainers are done."""

    NAME: ClassVar[str] = "finish progress"

    finished: int

    def __post_init__(self) -> None:
        _check_counts(self, "finished")


@dataclass(frozen=True, kw_only=True)
class CheckpointCompleted(_JsonMessage):
    """The answer to a `DenseCheckpoint`: checkpoint `checkpoint` is complete, and `kept`
    are the complete checkpoints the oracle keeps (oldest first), so that the shards can
    prune theirs."""

    NAME: ClassVar[str] = "checkpoint completion"

    checkpoint: int
    kept: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_counts(self, "checkpoint")
        kept = self.kept
        ok = isinstance(kept, list | tuple) and all(type(c) is int and c >= 0 for c in kept)
        _check(self, ok, "kept", "must be a list of non-negative integers, got %r", kept)
        object.__setattr__(self, "kept", tuple(kept))  # JSON gives a list; a frozen message wants a tuple


@dataclass(frozen=True, kw_only=True)
class ResumePoint(_JsonMessage):
    """The answer to ``GET /v1/checkpoint``: the checkpoint this run resumed from, or None."""

    NAME: ClassVar[str] = "resume point"

    resumed_from: int | None

    def __post_init__(self) -> None:
        _check_optional_count(self, "resumed_from")


@dataclass(frozen=True, kw_only=True)
class OracleHealth(_JsonMessage):
    """That the oracle answers (public: probes, curl), and how far it has planned."""

    NAME: ClassVar[str] = "health"
    ADDED: ClassVar[frozenset[str]] = frozenset({"term"})

    role: str
    mode: str
    trainers: int
    iterations: int  # of the whole run
    planned: int  # iterations whose directives are final
    term: int = 0  # how many times the job regrouped (an elastic job)

    def __post_init__(self) -> None:
        _check(self, isinstance(self.role, str), "role", "must be a string, got %r", self.role)
        _check(self, isinstance(self.mode, str), "mode", "must be a string, got %r", self.mode)
        _check_counts(self, "trainers", "iterations", "planned", "term")


# --------------------------------------------------------------------------- binary bodies
@dataclass(frozen=True, kw_only=True, eq=False)
class DenseCheckpoint:
    """Trainer 0's part of checkpoint `checkpoint`, sent once every shard saved its snapshot
    (``POST /v1/checkpoint``): the dense state as `torch.save` wrote it, and the figures the
    manifest records. On the wire: meta {checkpoint, bytes, seconds} and the array dense."""

    NAME: ClassVar[str] = "dense checkpoint"
    CONTENT_TYPE: ClassVar[str] = BINARY

    checkpoint: int
    dense: bytes
    nbytes: int  # the whole checkpoint: every snapshot and the dense state ("bytes")
    seconds: float

    def __post_init__(self) -> None:
        _check_counts(self, "checkpoint")
        _check(self, isinstance(self.dense, bytes), "dense", "must be bytes, got %s", type(self.dense).__name__)
        nbytes = self.nbytes
        _check(self, type(nbytes) is int and nbytes >= 0, "bytes", "must be a non-negative integer, got %r", nbytes)
        seconds = self.seconds
        _check(self, type(seconds) in (int, float) and seconds >= 0, "seconds", "must be a number >= 0, got %r",
               seconds)
        object.__setattr__(self, "seconds", float(seconds))

    def to_wire(self) -> bytes:
        meta = {"checkpoint": self.checkpoint, "bytes": self.nbytes, "seconds": self.seconds}
        return encode(meta, {"dense": np.frombuffer(self.dense, dtype=np.uint8)})

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> Self:
        meta, arrays = decode(body)
        dense = require(arrays, "dense", "|u1", 1)
        return cls(checkpoint=meta.get("checkpoint"), dense=dense.tobytes(), nbytes=meta.get("bytes"),
                   seconds=meta.get("seconds"))


# --------------------------------------------------------------------------- query parameters
#: The most digits a query parameter's value may have: below 2**63, and far from the length
#: at which int() of a string starts to cost (or hits Python's digit limit).
MAX_DIGITS = 18


@dataclass(frozen=True, kw_only=True)
class _QueryMessage:
    """Query parameters, each a non-negative integer: the dataclass's fields. Parameters a
    message does not know are ignored."""

    def to_wire(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_wire(cls, query: Mapping[str, str]) -> Self:
        """The message of a request's parameters; BadRequest naming the first one missing or
        not a non-negative decimal integer."""
        values: dict[str, int] = {}
        for f in fields(cls):
            raw = query.get(f.name)
            if raw is None:
                raise BadRequest(f"query parameter {f.name!r} is required", parameter=f.name)
            # isascii: str.isdigit accepts digits such as '²' that int() refuses.
            if not (raw.isascii() and raw.isdigit() and len(raw) <= MAX_DIGITS):
                raise BadRequest(f"query parameter {f.name!r} must be a non-negative integer of at most "
                                 f"{MAX_DIGITS} digits, got {raw[:40]!r}", parameter=f.name)
            values[f.name] = int(raw)
        return cls(**values)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 0:
                raise BadRequest(f"query parameter {f.name!r} must be a non-negative integer, got {quoted(value)}",
                                 parameter=f.name)

    def within(self, **bounds: tuple[int, int]) -> Self:
        """This message if each named parameter is in its (low, high) bounds, inclusive;
        BadRequest naming the first that is not. For what only the server knows."""
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise BadRequest(f"query parameter {name!r} must be an integer in {low}..{high}, got {value}",
                                 parameter=name)
        return self


@dataclass(frozen=True, kw_only=True)
class StreamRequest(_QueryMessage):
    """Trainer `trainer`'s steps from global iteration `start` on (``GET /v1/stream``)."""

    trainer: int
    start: int


@dataclass(frozen=True, kw_only=True)
class StreamAck(_QueryMessage):
    """Trainer `trainer` has received every step of its stream before `next` (``POST
    /v1/stream/ack``): only then do those steps count toward its position."""

    trainer: int
    next: int


@dataclass(frozen=True, kw_only=True)
class EvalRequest(_QueryMessage):
    """Trainer `trainer`'s share of the held-out rows (``GET /v1/eval``)."""

    trainer: int


@dataclass(frozen=True, kw_only=True)
class DenseRequest(_QueryMessage):
    """The dense state of complete checkpoint `checkpoint` (``GET /v1/dense``)."""

    checkpoint: int


@dataclass(frozen=True, kw_only=True)
class IngestBody:
    """Rows pushed to a stream (``POST /v1/ingest``): the body as the stream's format writes
    a file (Criteo TSV or Avazu CSV lines, or a parquet file). Checked whole by the oracle
    (`common.data.spool`), which answers 400 naming the bad line or row."""

    CONTENT_TYPE: ClassVar[str] = BINARY

    data: bytes

    def to_wire(self) -> bytes:
        return self.data

    @classmethod
    def from_wire(cls, body: bytes | bytearray | memoryview) -> IngestBody:
        return cls(data=bytes(body))


@dataclass(frozen=True, kw_only=True)
class IngestReceipt(_JsonMessage):
    """The answer to an `IngestBody`: it is on disk, as the stream's part `part`."""

    NAME: ClassVar[str] = "ingest receipt"

    part: str
    rows: int

    def __post_init__(self) -> None:
        _check(self, isinstance(self.part, str) and bool(self.part), "part", "must be a non-empty string, got %r",
               self.part)
        _check_counts(self, "rows")


# --------------------------------------------------------------------------- routes
@dataclass(frozen=True, kw_only=True)
class Route:
    """One (method, path) of the oracle and the messages it takes and answers."""

    method: str
    path: str
    request: type[Message] | None = None  # a body or query message; None: nothing asked
    response: type[Message] | None = None  # None: no message (204, Prometheus text, opaque bytes)
    stream: tuple[type[Message], ...] = ()  # a streamed answer: the messages it frames, in order
    public: bool = False  # served without the bearer token (probes, Prometheus)

    @property
    def takes_query(self) -> bool:
        return self.request is not None and issubclass(self.request, _QueryMessage)

    def target(self, query: _QueryMessage | None = None) -> str:
        """What a client asks for: the path, with `query`'s parameters on a route that
        takes them (TypeError for a message of another route: a bug, not the peer's)."""
        if not self.takes_query:
            if query is not None:
                raise TypeError(f"{self.method} {self.path} takes no query parameters")
            return self.path
        if type(query) is not self.request:
            raise TypeError(f"{self.method} {self.path} takes a {self.request.__name__}, not {query!r}")
        return f"{self.path}?{urlencode(query.to_wire())}"

    def read(self, request: Request) -> Any:
        """The route's request message of `request` (None on a route that takes none)."""
        if self.request is None:
            return None
        return self.request.from_wire(request.query if self.takes_query else request.body)


STREAM = Route(method="GET", path="/v1/stream", request=StreamRequest, stream=(TrainBatch, Directive, EndOfStream))
ACKNOWLEDGE = Route(method="POST", path="/v1/stream/ack", request=StreamAck)
HEALTH = Route(method="GET", path="/v1/health", response=OracleHealth, public=True)
METRICS = Route(method="GET", path="/metrics", public=True)
REGISTER = Route(method="POST", path="/v1/register", request=Registration, response=Joined)
EVAL = Route(method="GET", path="/v1/eval", request=EvalRequest, stream=(EvalBatch, EndOfStream))
FINISHED = Route(method="POST", path="/v1/finished", request=Finished, response=FinishProgress)
COMPLETE_CHECKPOINT = Route(method="POST", path="/v1/checkpoint", request=DenseCheckpoint, response=CheckpointCompleted)
RESUME_POINT = Route(method="GET", path="/v1/checkpoint", response=ResumePoint)
DENSE = Route(method="GET", path="/v1/dense", request=DenseRequest)  # torch.save's bytes
PRESENCE = Route(method="POST", path="/v1/presence", request=Presence, response=PresenceAnswer)
STOP = Route(method="POST", path="/v1/stop")  # a stream ends at its next checkpoint (202)
INGEST = Route(method="POST", path="/v1/ingest", request=IngestBody, response=IngestReceipt)

#: What `oracle.service` serves.
SERVICE_ROUTES: tuple[Route, ...] = (STREAM, ACKNOWLEDGE, HEALTH, METRICS, STOP, INGEST)
#: What `oracle.coordinator_service` serves.
COORDINATOR_ROUTES: tuple[Route, ...] = (REGISTER, EVAL, FINISHED, COMPLETE_CHECKPOINT, RESUME_POINT, DENSE,
                                         PRESENCE)
ROUTES: tuple[Route, ...] = SERVICE_ROUTES + COORDINATOR_ROUTES

Answer = Response | StreamResponse
#: A route's handler: given the route's request message (or None), its response message,
#: or a `Response` / `StreamResponse` of its own; or an awaitable of either.
TypedHandler = Callable[[Any], Any]


def add_handlers(router: Router, handlers: Mapping[Route, TypedHandler]) -> None:
    """Serve each route of `handlers` on `router`: its request decoded by the route, its
    answer encoded. A handler that answers at once is answered without a task."""
    for route, handler in handlers.items():
        router.add(route.method, route.path, _serve(route, handler), public=route.public)


def _serve(route: Route, handler: TypedHandler) -> Callable[[Request], Answer | Awaitable[Answer]]:
    def serve(request: Request) -> Answer | Awaitable[Answer]:
        answer = handler(route.read(request))
        if inspect.isawaitable(answer):
            return Then(answer, functools.partial(_encoded, route))
        return _encoded(route, answer)

    return serve


def _encoded(route: Route, answer: Any) -> Answer:
    if isinstance(answer, Response | StreamResponse):
        return answer
    if route.response is None or type(answer) is not route.response:
        raise TypeError(f"{route.method} {route.path} answers {route.response}, not {answer!r}")
    return Response(body=answer.to_wire(), content_type=answer.CONTENT_TYPE)  # type: ignore[attr-defined]


async def ask(client: Client, route: Route, message: Any = None, *, timeout: float | None = None) -> Any:
    """`route` asked of the oracle through `client`, with `message` (its query or its body);
    the answer decoded (the body itself on a route that answers no message). Any error the
    oracle answers is raised (`Client.call`)."""
    query = message if route.takes_query else None
    body = b"" if message is None or route.takes_query else message.to_wire()
    answer = await client.call(route.method, route.target(query), body=body, timeout=timeout)
    return answer if route.response is None else route.response.from_wire(answer)


# --------------------------------------------------------------------------- checks
def _check(message: object, ok: bool, field: str, problem: str, *args: object) -> None:
    """WireError naming `field` of `message` (a message or its class) unless `ok`;
    `problem % args` is formatted only then, each value quoted to a few hundred bytes."""
    if not ok:
        name = message.NAME  # type: ignore[attr-defined]
        shown = tuple(a if type(a) in (int, float) else _Quoted(a) for a in args)
        raise WireError(f"invalid {name}: {field} {problem % shown}", field=field)


class _Quoted:
    """A value in a `_check` message: at most a few hundred characters of it (`quoted`)."""

    def __init__(self, value: object) -> None:
        self._value = value

    def __repr__(self) -> str:
        return quoted(self._value)

    def __str__(self) -> str:
        return clipped(str(self._value))


def _check_counts(message: object, *names: str) -> None:
    """Each named field a non-negative integer (a bool is not one)."""
    for name in names:
        value = getattr(message, name)
        _check(message, type(value) is int and value >= 0, name, "must be a non-negative integer, got %r", value)


def _check_optional_count(message: object, name: str) -> None:
    value = getattr(message, name)
    ok = value is None or (type(value) is int and value >= 0)
    _check(message, ok, name, "must be a non-negative integer or null, got %r", value)


def _endpoint(message: type, raw: object, field: str) -> Endpoint:
    """The Endpoint a 'host:port' string names; WireError naming `field` otherwise."""
    try:
        return Endpoint.parse(raw, field)
    except BagpipeError as exc:
        problem = exc.message.removeprefix(f"{field}: ")  # a ConfigError's message names the field first
        raise WireError(f"invalid {message.NAME}: {field} {problem}", field=field) from None  # type: ignore[attr-defined]


def _facts(raw: Any) -> DataFacts:
    """DataFacts of the JSON object a `Joined` carries; WireError naming the field otherwise."""
    _check(Joined, isinstance(raw, dict), "facts", "must be an object, got %r", raw)
    sizes, num_dense, iterations = raw.get("table_sizes"), raw.get("num_dense"), raw.get("iterations")
    ok = isinstance(sizes, list) and all(type(n) is int and n > 0 for n in sizes)
    _check(Joined, ok, "facts.table_sizes", "must be a list of positive integers, got %r", sizes)
    for name, value in (("num_dense", num_dense), ("iterations", iterations)):
        ok = type(value) is int and value >= 0
        _check(Joined, ok, f"facts.{name}", "must be a non-negative integer, got %r", value)
    return DataFacts(table_sizes=tuple(sizes), num_dense=num_dense, iterations=iterations)
