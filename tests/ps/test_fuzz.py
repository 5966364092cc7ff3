"""Mutation fuzzing of every PS route: requests derived from valid ones (bodies mutated in
their structure and their bytes, headers, query strings, methods, paths) never get a 5xx,
never hang, and change nothing when refused.

Two tiers over the same cases: in process through the route table (`Gate.admit` and `run_handler`: the decode
path and the store, many cases) and over loopback on both protocols (HTTP/2 and HTTP/1.1,
each in clear and over TLS, fewer cases). Every case is counted by route and answer; the counts are logged (run with
``-o log_cli=true --log-cli-level=INFO`` to see them).

Two answers are not failures, by design: a fetch for a version that does not arrive in the
shard's wait answers 504 ``timeout`` (docs/design.md#fetch-waits), and a checkpoint report naming more than
one trainer waits for the others; such a report is counted and not sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote

import numpy as np
import orjson
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import BagpipeError, WireError
from common.transport import Client, Request, Response, Tls, connect_client
from common.transport.http import Gate, error_response, run_handler
from ps.protocol import INCARNATION_HEADER, CheckpointReport
from ps.service import PsService
from ps.store import ShardConfig, ShardStore
from tests.ps.conftest import DIM, LAYOUT, TOKEN, make_server, raw_state, same_state
from tests.tls_fixtures import TlsFiles

log = logging.getLogger(__name__)

LIMIT = 60
EVERY = 3
#: The shard's fetch timeout: a fetch for a version that never comes answers 504 this fast.
FETCH_WAIT_S = 0.1
#: A request that takes longer hangs.
HANG_S = 5.0
KEYS = st.lists(st.sampled_from(range(0, 40, 2)), min_size=1, max_size=6, unique=True)
#: JSON values that broke or could break a decoder: types, signs, int64 and uint64 edges.
INTERESTING: list[Any] = [
    -1, 0, 1, 2, LIMIT, LIMIT + 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
    0.5, -0.0, 1e308, True, False, None, "", "7", "evict", "flush", [], [1], ["evict"], {}, {"a": 1},
    {"evict": 1},
]
WIRE_DTYPES = ["<f4", "<f8", "<i4", "<i8", "<u8", "<i2", "|u1", "|i1", "|O", ">i8", "<c16", 7, None]


@dataclass(frozen=True)
class Case:
    route: str  # the path of the valid request this one derives from (for counting)
    method: str
    target: str  # path and query
    headers: tuple[tuple[str, str], ...]
    body: bytes


# --------------------------------------------------------------------------- valid requests
def binary(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> tuple[dict[str, Any], bytes]:
    """A wire header (as a dict, to mutate) and the arrays' payload, as `common.wire` lays them."""
    specs, payload = [], b""
    for name, arr in arrays.items():
        specs.append([name, arr.dtype.str, list(arr.shape)])
        payload += arr.tobytes() + bytes(-arr.nbytes % 8)
    return {"meta": meta, "arrays": specs}, payload


def wire_body(header: Any, payload: bytes) -> bytes:
    head = orjson.dumps(header)
    return len(head).to_bytes(4, "little") + head + bytes(-(4 + len(head)) % 8) + payload


@st.composite
def fetches(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    keys = np.array(draw(KEYS), dtype=np.int64)
    wanted = np.array([draw(st.sampled_from([-1, -1, 0, 2, LIMIT])) for _ in keys], dtype=np.int64)
    meta = draw(st.sampled_from([{}, {"wait_s": FETCH_WAIT_S / 2}]))
    return binary(meta, {"keys": keys, "min_versions": wanted})


@st.composite
def write_backs(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    keys = np.array(draw(KEYS), dtype=np.int64)
    kind = draw(st.sampled_from(["evict", "flush"]))
    version = draw(st.sampled_from(range(EVERY - 1, LIMIT, EVERY)) if kind == "flush" else st.integers(0, LIMIT))
    meta = {"write": kind, "version": version, "replay": draw(st.booleans())}
    rows = np.full((len(keys), DIM), draw(st.integers(-3, 3)), np.float32)
    return binary(meta, {"keys": keys, "rows": rows, "state": np.ones((len(keys), 1), np.float32)})


CHECKPOINTS = st.sampled_from(range(EVERY - 1, LIMIT, EVERY))
CONTROL: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/v1/checkpoint/report": st.fixed_dictionaries({"checkpoint": CHECKPOINTS, "trainer": st.just(0), "trainers": st.just(1)}),
    "/v1/checkpoint/snapshot": st.fixed_dictionaries({"checkpoint": CHECKPOINTS}),
    "/v1/restore": st.fixed_dictionaries({"checkpoint": CHECKPOINTS}),
    "/v1/rejoined": st.fixed_dictionaries({"trainer": st.just(0), "trainers": st.just(1)}),
}
BINARY = {"/v1/fetch": fetches(), "/v1/write_back": write_backs()}
GETS = ["/v1/health", "/v1/status", "/metrics"]


# --------------------------------------------------------------------------- mutations
def mutate_json(draw: st.DrawFn, value: dict[str, Any]) -> Any:
    """A field replaced, dropped or added, or the whole value replaced."""
    value = dict(value)
    how = draw(st.sampled_from(["replace", "replace", "drop", "add", "whole"]))
    if how == "whole":
        return draw(st.sampled_from(INTERESTING))
    if how == "add" or not value:
        value[draw(st.sampled_from(["extra", "version", "arrays", "meta", ""]))] = draw(st.sampled_from(INTERESTING))
    elif how == "drop":
        del value[draw(st.sampled_from(sorted(value)))]
    else:
        value[draw(st.sampled_from(sorted(value)))] = draw(st.sampled_from(INTERESTING))
    return value


def mutate_specs(draw: st.DrawFn, specs: list[Any]) -> Any:
    """An array's name, dtype or shape changed, an array dropped or repeated."""
    specs = [list(s) for s in specs]
    i = draw(st.integers(0, len(specs) - 1))
    how = draw(st.sampled_from(["name", "dtype", "dim", "dim", "rank", "drop", "repeat", "whole"]))
    if how == "name":
        specs[i][0] = draw(st.sampled_from(["keys", "rows", "state", "min_versions", "x", "", 3]))
    elif how == "dtype":
        specs[i][1] = draw(st.sampled_from(WIRE_DTYPES))
    elif how == "dim" and specs[i][2]:
        shape = list(specs[i][2])
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from(INTERESTING))
        specs[i][2] = shape
    elif how == "rank":
        specs[i][2] = draw(st.sampled_from([[], [0] * 65, [0, 2**63], [0, 2**62, 4], [1] * 9, [0] * 8, "3"]))
    elif how == "drop":
        del specs[i]
    elif how == "repeat":
        specs.append(specs[i])
    else:
        return draw(st.sampled_from(INTERESTING))
    return specs


def mutate_bytes(draw: st.DrawFn, body: bytes) -> bytes:
    """Bytes flipped, cut, inserted or the body truncated."""
    data = bytearray(body)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        how = draw(st.sampled_from(["flip", "cut", "insert", "truncate"]))
        if how == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del data[at : at + draw(st.integers(1, 16))]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[at:]
    return bytes(data)


@st.composite
def bodies(draw: st.DrawFn, route: str) -> bytes:
    """A valid body of `route`, maybe mutated in its structure or its bytes."""
    how = draw(st.sampled_from(["valid", "valid", "structure", "structure", "bytes"]))
    if route in BINARY:
        header, payload = draw(BINARY[route])
        if how == "structure":
            part = draw(st.sampled_from(["meta", "arrays", "payload", "header"]))
            if part == "meta":
                header = {**header, "meta": mutate_json(draw, header["meta"])}
            elif part == "arrays":
                header = {**header, "arrays": mutate_specs(draw, header["arrays"])}
            elif part == "payload":
                payload = mutate_bytes(draw, payload)
            else:
                header = mutate_json(draw, header)
        body = wire_body(header, payload)
    elif route in CONTROL:
        value: Any = draw(CONTROL[route])
        if how == "structure":
            value = mutate_json(draw, value)
        body = orjson.dumps(value)
    else:
        body = b"" if how != "bytes" else draw(st.binary(max_size=32))
    return mutate_bytes(draw, body) if how == "bytes" and body else body


#: Printable, URL-safe characters for targets and header values (a client refuses others).
URL_TEXT = st.text(alphabet="abcz019-_.~%=&+/", max_size=12)
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)


@st.composite
def cases(draw: st.DrawFn, incarnation: str) -> Case:
    route = draw(st.sampled_from([*BINARY, *CONTROL, *GETS]))
    method = "GET" if route in GETS else "POST"
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
    target = route
    what = draw(st.integers(0, 9))
    if what == 0:
        target = draw(st.sampled_from([route + "/", route.upper(), "/" + route, route + "/..", route.replace("/", "/%2F", 1)]))
    elif what == 1:
        target = f"{route}?{draw(URL_TEXT)}"
    headers = {"authorization": f"Bearer {TOKEN}"}
    if draw(st.integers(0, 9)) == 0:
        headers["authorization"] = draw(st.sampled_from(["", "Bearer", f"Bearer {TOKEN}x", "Basic abc"]))
    meant = draw(st.sampled_from([None, None, incarnation, incarnation, "0" * 16, ""]))
    if meant is not None:
        headers[INCARNATION_HEADER] = meant
    if draw(st.integers(0, 9)) == 0:
        headers[draw(st.sampled_from(["content-type", "x-extra", INCARNATION_HEADER]))] = draw(HEADER_TEXT)
    return Case(route, method, target, tuple(headers.items()), draw(bodies(route)))


# --------------------------------------------------------------------------- the checks
#: Sends a case and answers (status, body); closes what it opened; opens both for a shard.
Send = Callable[[Case], Awaitable[tuple[int, bytes]]]
Close = Callable[[], Awaitable[None]]
Connect = Callable[[PsService], Awaitable[tuple[Send, Close]]]


def fuzz_service(directory: Path) -> PsService:
    cfg = ShardConfig(shard=0, num_shards=2, layout=LAYOUT, dim=DIM, state_width=1, seed=3,
                      checkpoint_every=EVERY, version_limit=LIMIT)
    return PsService(ShardStore(cfg), checkpoint_dir=directory / "ps-0", fetch_timeout_s=FETCH_WAIT_S)


def served_path(case: Case) -> str:
    """The path the shard routes the case by (query dropped, percent-decoded)."""
    return unquote(case.target.partition("?")[0])


def waits_by_design(case: Case) -> bool:
    """A well-formed report naming more than one trainer: it waits for the others."""
    if case.method != "POST" or served_path(case) != "/v1/checkpoint/report":
        return False
    try:
        return CheckpointReport.from_wire(case.body).trainers > 1
    except WireError:
        return False


def judge(case: Case, status: int, payload: bytes) -> str:
    """The outcome's name for the counts; fails the test for a 5xx that is not by design."""
    if status == 504 and served_path(case) == "/v1/fetch" and orjson.loads(payload)["error"] == "timeout":
        return "504 (a version that never came)"
    assert status < 500, f"{status} for {case}: {payload[:300]!r}"
    return f"{status // 100}xx"


async def check(
    service: PsService, case: Case, send: Send, counts: Counter[str], hang_s: float = HANG_S
) -> None:
    if waits_by_design(case):
        counts[f"{case.route} not sent: waits for other trainers"] += 1
        return
    before = raw_state(service.store)
    status, payload = await asyncio.wait_for(send(case), hang_s)
    outcome = judge(case, status, payload)
    counts[f"{case.route} {outcome}"] += 1
    if not 200 <= status < 300 and not same_state(before, raw_state(service.store)):
        pytest.fail(f"{status} changed the shard: {case}")


def run_fuzz(directory: Path, examples: int, connect: Connect) -> Counter[str]:
    """`examples` cases against one shard whose state builds up across them."""
    counts: Counter[str] = Counter()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        service = fuzz_service(directory)
        send, close = runner.run(connect(service))

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=cases(service.incarnation))
        def one(case: Case) -> None:
            runner.run(check(service, case, send, counts))

        try:
            one()
        finally:
            runner.run(close())
    log.info("%d cases: %s", sum(counts.values()), dict(sorted(counts.items())))
    assert sum(counts.values()) >= examples * 0.9  # hypothesis ran them all (it may run a few more)
    return counts


async def in_process(service: PsService) -> tuple[Send, Close]:
    gate = Gate(service.router(), TOKEN, max_body_bytes=1 << 28)

    async def send(case: Case) -> tuple[int, bytes]:
        request = Request(method=case.method, path=served_path(case), query=dict(parse_qsl(case.target.partition("?")[2])),
                          headers=dict(case.headers), body=case.body)
        try:  # what a server does: admit on the headers, then run the handler
            answer = await run_handler(gate.admit(request.method, request.path, request.headers), request)
        except BagpipeError as err:
            answer = error_response(err)
        assert isinstance(answer, Response)  # no PS route streams
        body = answer.body if isinstance(answer.body, bytes) else b"".join(bytes(p) for p in answer.body)
        return answer.status, body

    async def close() -> None:
        return None

    return send, close


def over(kind: str, tls: Tls | None = None) -> Connect:
    async def connect(service: PsService) -> tuple[Send, Close]:
        server = make_server(kind, service, tls=tls)
        await server.start()
        client: Client = connect_client(kind, "127.0.0.1", server.port, token=None, timeout=HANG_S,  # type: ignore[arg-type]
                                        tls=tls)

        async def send(case: Case) -> tuple[int, bytes]:
            answer = await client.request(case.method, case.target, body=case.body, headers=dict(case.headers))
            return answer.status, answer.body

        async def close() -> None:
            health = await client.request("GET", "/v1/health")  # still serving after all that
            assert health.status == 200
            await client.close()
            await server.stop()

        return send, close

    return connect


def test_fuzz_in_process_never_5xx_and_refusals_change_nothing(tmp_path: Path) -> None:
    counts = run_fuzz(tmp_path, 600, in_process)
    assert any(k.endswith("2xx") for k in counts) and any(k.endswith("4xx") for k in counts)


@pytest.mark.parametrize("security", ["plain", "tls"])
@pytest.mark.parametrize("kind", ["h2", "http1"])
def test_fuzz_over_loopback_never_5xx_never_hangs(tmp_path: Path, kind: str, security: str, tls_files: TlsFiles) -> None:
    run_fuzz(tmp_path, 150, over(kind, tls_files.tls() if security == "tls" else None))


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("kind", ["in-process", "h2", "http1"])
def test_fuzz_at_length(tmp_path: Path, kind: str) -> None:
    run_fuzz(tmp_path, 4000, in_process if kind == "in-process" else over(kind))


def test_a_hang_or_a_5xx_fails_the_fuzz(tmp_path: Path) -> None:
    """The checks themselves: a 500, a changed shard after a refusal and a hang all fail."""
    service = fuzz_service(tmp_path)
    case = Case("/v1/fetch", "POST", "/v1/fetch", (), b"")

    async def answer(status: int, change: bool = False, delay: float = 0.0) -> tuple[int, bytes]:
        await asyncio.sleep(delay)
        if change:
            service.store.max_version += 1
        return status, orjson.dumps(BagpipeError("x").to_json())

    for send, error in [
        (lambda c: answer(500), AssertionError),
        (lambda c: answer(400, change=True), pytest.fail.Exception),
        (lambda c: answer(200, delay=0.5), TimeoutError),
    ]:
        with pytest.raises(error):
            asyncio.run(check(service, case, send, Counter(), hang_s=0.1))
