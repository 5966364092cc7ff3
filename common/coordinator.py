"""Joining a job through its coordinator (the oracle): the one address a PS shard or a
trainer needs.

A role started with ``--coordinator HOST:PORT`` and the token registers with the oracle:
``POST /v1/register`` with its role, its index (or none: the oracle assigns the lowest
free one) and the address it serves on, and gets back the job (`Joined`): the spec
document, the facts of the data, the PS shards' addresses and, for trainers, where their
process group meets. A trainer's registration is answered once every PS shard has
registered. The messages are JSON; the oracle's side is `oracle.coordinator`.

A role that also has the spec file must have the very same document: a role of another job
is refused (409) rather than trained with the wrong tables. Another run's token is refused
(401) before anything else.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson

from common.errors import BadRequest, BagpipeError, Unauthorized, Unavailable, WireError, quoted
from common.job import DataFacts, Job, job_from_facts
from common.spec import TOKEN_ENV, ClusterSpec, Endpoint, parse_spec
from common.transport import Tls, TransportKind, connect_client
from common.wire import decode, encode, require
from common.transport.retry import RetryBudget

log = logging.getLogger(__name__)

Role = Literal["ps", "trainer"]
REGISTER_PATH = "/v1/register"
#: How long the oracle holds a trainer's registration waiting for the PS shards; the trainer
#: asks again until its `reconnect_s` runs out.
REGISTER_HOLD_S = 20.0


def fingerprint(document: dict[str, Any]) -> str:
    """A digest of a spec document: equal for the same TOML content however it is spelt."""
    return hashlib.sha256(orjson.dumps(document, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class Registration:
    """What a role tells the coordinator when it joins."""

    role: Role
    index: int | None
    address: Endpoint  # where it serves (a PS), or its host (a trainer: port 0)
    fingerprint: str | None = None  # of its own spec file, when it has one

    def to_json(self) -> bytes:
        return orjson.dumps({"role": self.role, "index": self.index, "address": str(self.address),
                             "fingerprint": self.fingerprint})

    @classmethod
    def from_json(cls, body: bytes) -> Registration:
        try:
            raw = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"registration is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise BadRequest("registration must be a JSON object")
        role, index, fp = raw.get("role"), raw.get("index"), raw.get("fingerprint")
        if role not in ("ps", "trainer"):
            raise BadRequest(f"role must be 'ps' or 'trainer', got {quoted(role)}", field="role")
        if index is not None and (type(index) is not int or index < 0):
            raise BadRequest(f"index must be a non-negative integer or null, got {quoted(index)}", field="index")
        if fp is not None and not isinstance(fp, str):
            raise BadRequest("fingerprint must be a string or null", field="fingerprint")
        try:
            address = Endpoint.parse(raw.get("address"), "address")
        except BagpipeError as exc:
            raise BadRequest(exc.message, field="address") from None
        if role == "ps" and address.port == 0:
            raise BadRequest(f"a PS shard registers the address it serves on, not {address}: port 0 "
                             "is none", field="address")
        return cls(role=role, index=index, address=address, fingerprint=fp)


@dataclass(frozen=True, kw_only=True, eq=False)
class DenseCheckpoint:
    """Trainer 0's part of checkpoint `checkpoint`, sent once every shard saved its snapshot
    (``POST /v1/checkpoint``): the dense state as `torch.save` wrote it, and the figures the
    manifest records."""

    checkpoint: int
    dense: bytes
    nbytes: int  # the whole checkpoint: every snapshot and the dense state
    seconds: float

    def encode(self) -> bytes:
        meta = {"checkpoint": self.checkpoint, "bytes": self.nbytes, "seconds": self.seconds}
        return encode(meta, {"dense": np.frombuffer(self.dense, dtype=np.uint8)})

    @classmethod
    def decode(cls, body: bytes) -> DenseCheckpoint:
        meta, arrays = decode(body)
        c, nbytes, seconds = meta.get("checkpoint"), meta.get("bytes"), meta.get("seconds")
        if type(c) is not int or c < 0 or type(nbytes) is not int or not isinstance(seconds, int | float):
            raise WireError("a dense checkpoint needs an integer checkpoint >= 0, bytes and seconds")
        dense = require(arrays, "dense", "|u1", 1)
        return cls(checkpoint=c, dense=dense.tobytes(), nbytes=nbytes, seconds=float(seconds))


@dataclass(frozen=True, kw_only=True)
class Joined:
    """The coordinator's answer: who this role is and everything it needs to run."""

    index: int
    document: dict[str, Any]
    facts: DataFacts
    ps: tuple[Endpoint, ...]  # every shard, in index order (trainers); empty for a PS
    store: Endpoint | None  # the trainers' rendezvous store (trainers)
    generation: int  # how many times this index joined before: a restart's fresh group key
    resumed_from: int | None = None  # the checkpoint this run resumed from (`--resume`)

    def to_json(self) -> bytes:
        return orjson.dumps({
            "index": self.index, "document": self.document, "facts": self.facts.to_json(),
            "ps": [str(e) for e in self.ps], "store": None if self.store is None else str(self.store),
            "generation": self.generation, "resumed_from": self.resumed_from,
        })

    @classmethod
    def from_json(cls, body: bytes) -> Joined:
        try:
            raw = orjson.loads(body)
            facts = raw["facts"]
            return cls(
                index=int(raw["index"]),
                document=dict(raw["document"]),
                facts=DataFacts(table_sizes=tuple(int(n) for n in facts["table_sizes"]),
                                num_dense=int(facts["num_dense"]), iterations=int(facts["iterations"])),
                ps=tuple(Endpoint.parse(e, "ps") for e in raw["ps"]),
                store=None if raw["store"] is None else Endpoint.parse(raw["store"], "store"),
                generation=int(raw["generation"]),
                resumed_from=None if raw.get("resumed_from") is None else int(raw["resumed_from"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise WireError(f"malformed answer from the coordinator: {exc!r}") from None

    def job(self, coordinator: Endpoint) -> Job:
        """The job, its spec rebuilt from the document; the data is never opened."""
        source = Path(f"coordinator-{coordinator.host}-{coordinator.port}.toml")
        return job_from_facts(parse_spec(self.document, source), self.facts)


class CoordinatorClient:
    """A PS shard's or trainer's line to the coordinator at `endpoint` (over TLS with `tls`,
    which the role's servers then use too). With `spec` (a role given the spec file too) the
    registration carries its fingerprint, so that the coordinator refuses a role of another
    job."""

    def __init__(self, endpoint: Endpoint, *, token: str, transport: TransportKind = "h2",
                 spec: ClusterSpec | None = None, reconnect_s: float = 30.0, tls: Tls | None = None) -> None:
        self.endpoint = endpoint
        self.reconnect_s = reconnect_s
        self.tls = tls
        self._fingerprint = None if spec is None else fingerprint(spec.document)
        self._client = connect_client(transport, endpoint.host, endpoint.port, token=token,
                                      timeout=REGISTER_HOLD_S + 10, tls=tls)

    async def join(self, role: Role, index: int | None, address: Endpoint) -> Joined:
        """Register, asking again while the coordinator is unreachable or still waits for
        the PS shards, for up to `reconnect_s`; then Unavailable naming it."""
        registration = Registration(role=role, index=index, address=address, fingerprint=self._fingerprint)
        budget = RetryBudget(retries=3, window_s=self.reconnect_s, first_delay_s=0.2)
        while True:
            try:
                return Joined.from_json(await self._client.call("POST", REGISTER_PATH, body=registration.to_json()))
            except Unauthorized:
                raise Unauthorized(f"the coordinator at {self.endpoint} refused this role's token: "
                                   f"${TOKEN_ENV} must be its job's") from None
            except Unavailable as exc:
                if not budget.allows_retry():
                    raise Unavailable(f"the coordinator at {self.endpoint} is unreachable or not ready "
                                      f"after {budget.waited_s:.0f} s: {exc.message}") from None
                log.info("coordinator at %s: %s; asking again", self.endpoint, exc.message)
                await budget.wait()

    async def watch(self, reconnect_s: float, every_s: float = 2.0) -> None:
        """Return (as Unavailable) only once the coordinator has been unreachable for
        `reconnect_s`: a role whose job is gone must not serve for ever."""
        lost: float | None = None
        while True:
            await asyncio.sleep(every_s)
            try:
                await self._client.call("GET", "/v1/health", timeout=every_s * 2)
                lost = None
            except Unavailable:
                lost = lost or time.monotonic()
                if time.monotonic() - lost >= reconnect_s:
                    raise Unavailable(f"the coordinator at {self.endpoint} has been unreachable for "
                                      f"{reconnect_s:g} s (cluster.reconnect_s)") from None

    async def complete_checkpoint(self, done: DenseCheckpoint) -> list[int]:
        """Have the coordinator make checkpoint `done.checkpoint` complete; the complete
        checkpoints it keeps."""
        answer = orjson.loads(await self._client.call("POST", "/v1/checkpoint", body=done.encode()))
        return [int(c) for c in answer["kept"]]

    async def resumed_from(self) -> int | None:
        """The checkpoint the coordinator's run resumed from, or None."""
        answer = orjson.loads(await self._client.call("GET", "/v1/checkpoint"))
        return None if answer["resumed_from"] is None else int(answer["resumed_from"])

    async def dense_state(self, checkpoint: int) -> bytes:
        return await self._client.call("GET", f"/v1/dense?checkpoint={checkpoint}")

    async def close(self) -> None:
        await self._client.close()


def address_towards(host: str) -> str:
    """This machine's address on the route to `host`: where peers on that network reach us
    (not the loopback address the hostname may resolve to). No packet is sent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError as exc:
            raise Unavailable(f"no route to {host}: {exc}") from None
        return probe.getsockname()[0]


async def serve_address(bind: Endpoint | None, coordinator: Endpoint) -> Endpoint:
    """Where a role serves: `bind` when given, else its address towards the coordinator
    (port 0: any free one)."""
    if bind is not None:
        return bind
    return Endpoint(host=await asyncio.to_thread(address_towards, coordinator.host), port=0)



def listen_on(address: Endpoint) -> socket.socket:
    """A socket listening on `address` (port 0: a free one, `getsockname` says which), for a
    role that must name where it serves before its servers start: what connects meanwhile
    waits in the kernel's backlog. Unavailable naming the address if it cannot listen."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    try:
        return socket.create_server((address.host, address.port), family=family, backlog=1024)
    except OSError as exc:
        hint = ": another process listens there" if exc.errno == errno.EADDRINUSE else ""
        raise Unavailable(f"cannot listen on {address}: {exc.strerror or exc}{hint}",
                          address=str(address)) from None


def free_port(host: str) -> int:
    """A port free on `host` now (for a role that must name its port before it listens)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
