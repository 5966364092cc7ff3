"""Mutation fuzzing of the oracle's routes (``GET /v1/stream?trainer=&start=``, health,
metrics) on both protocols: requests derived from valid ones (query values and names,
methods, paths, token) never get a 5xx and never hang; a stream that is answered is read to
its end message. Counts per route and answer are logged (``-o log_cli=true
--log-cli-level=INFO``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.steps import EndOfStream, kind_of
from common.transport import Client, H2Server, Http1Server, connect_client, read_messages
from oracle.service import OracleService
from tests.oracle.test_service import N, T, TOKEN, config, settled, workload

log = logging.getLogger(__name__)

#: A request that takes longer hangs (a whole stream of N small steps included).
HANG_S = 10.0
VALUES = st.one_of(
    st.integers(-3, N + 3).map(str),
    st.sampled_from([
        "", "+1", " 1", "1 ", "01", "0x1", "1e3", "1.0", "-0", str(2**63), str(2**64 - 1), str(2**64), "9" * 400,
        "%C2%B2", "%D9%A1", "%00", "%zz", "%", "true", "null", "0&start=0",
    ]),
)
NAMES = st.sampled_from(["trainer", "start", "trainer", "start", "Trainer", "x", ""])


@st.composite
def queries(draw: st.DrawFn) -> str:
    """trainer= and start= with valid or odd values, one missing, repeated or renamed."""
    pairs = [("trainer", str(draw(st.integers(0, T - 1)))), ("start", str(draw(st.integers(0, N))))]
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(["value", "value", "name", "drop", "add"]))
        i = draw(st.integers(0, max(len(pairs) - 1, 0)))
        if how == "add" or not pairs:
            pairs.append((draw(NAMES), draw(VALUES)))
        elif how == "drop":
            del pairs[i]
        elif how == "name":
            pairs[i] = (draw(NAMES), pairs[i][1])
        else:
            pairs[i] = (pairs[i][0], draw(VALUES))
    return "&".join(f"{k}={v}" if draw(st.integers(0, 9)) else k for k, v in pairs)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str]]:
    route = draw(st.sampled_from(["/v1/stream", "/v1/stream", "/v1/stream", "/v1/health", "/metrics"]))
    target = f"{route}?{draw(queries())}" if route == "/v1/stream" or draw(st.booleans()) else route
    if draw(st.integers(0, 9)) == 0:
        target = draw(st.sampled_from([route + "/", route.upper(), "/" + route, route + "/.."]))
    method = "GET" if draw(st.integers(0, 9)) else draw(st.sampled_from(["POST", "PUT", "DELETE"]))
    token = f"Bearer {TOKEN}" if draw(st.integers(0, 9)) else draw(st.sampled_from(["", "Bearer x"]))
    return method, target, {"authorization": token}


async def answer(client: Client, method: str, target: str, headers: dict[str, str]) -> tuple[int, int]:
    """Status, and the messages of the stream (read to its end message) or 0."""
    response = await client.request(method, target, headers=headers)
    if response.status != 200 or not target.startswith("/v1/stream"):
        return response.status, 0

    async def body() -> AsyncIterator[bytes]:
        yield response.body

    messages = [m async for m in read_messages(body())]
    assert messages and kind_of(messages[-1]) == "end", f"{target}: no end message"
    EndOfStream.from_wire(messages[-1])
    return response.status, len(messages)


def run_fuzz(kind: str, examples: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        # Back-pressure never stops a fuzzed stream: the whole run fits in max_ahead.
        service = OracleService(config(), workload(), max_ahead=N + 8)
        server = (H2Server if kind == "h2" else Http1Server)(service.router(), host="127.0.0.1", port=0, token=TOKEN)

        async def start() -> None:
            await server.start()
            service.start()  # planning starts from the event loop

        runner.run(start())
        client = connect_client(kind, "127.0.0.1", server.port, token=None, timeout=HANG_S)  # type: ignore[arg-type]
        # The planner compiles on first use (seconds on a cold cache): fuzz a planned run.
        runner.run(settled(lambda: service.progress.iterations, N, deadline_s=120))

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(request=requests())
        def one(request: tuple[str, str, dict[str, str]]) -> None:
            method, target, headers = request
            status, _ = runner.run(asyncio.wait_for(answer(client, method, target, headers), HANG_S))
            counts[f"{target.partition('?')[0]} {status}"] += 1
            assert status < 500, f"{status} for {method} {target}"

        try:
            one()
            assert runner.run(client.request("GET", "/v1/health")).status == 200
        finally:
            runner.run(client.close())
            service.stop()
            runner.run(server.stop())
    log.info("%s: %d cases: %s", kind, sum(counts.values()), dict(sorted(counts.items())))
    assert sum(counts.values()) >= examples * 0.9
    return counts


@pytest.mark.parametrize("kind", ["h2", "http1"])
def test_oracle_routes_never_5xx_never_hang(kind: str) -> None:
    counts = run_fuzz(kind, 150)
    assert counts["/v1/stream 200"] and counts["/v1/stream 400"]


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("kind", ["h2", "http1"])
def test_oracle_routes_at_length(kind: str) -> None:
    run_fuzz(kind, 2000)


@pytest.mark.parametrize("kind", ["h2", "http1"])
@pytest.mark.parametrize("start", [str(2**64), "9" * 400], ids=["2**64", "400 nines"])
def test_a_start_past_uint64_is_a_400_not_a_reset_stream(kind: str, start: str) -> None:
    async def ask() -> int:
        service = OracleService(config(), workload(), max_ahead=N + 8)
        server = (H2Server if kind == "h2" else Http1Server)(service.router(), host="127.0.0.1", port=0, token=TOKEN)
        await server.start()
        service.start()
        client = connect_client(kind, "127.0.0.1", server.port, token=TOKEN, timeout=HANG_S)  # type: ignore[arg-type]
        try:
            status, _ = await answer(client, "GET", f"/v1/stream?trainer=0&start={start}", {})
            return status
        finally:
            await client.close()
            service.stop()
            await server.stop()

    assert asyncio.run(ask()) == 400
