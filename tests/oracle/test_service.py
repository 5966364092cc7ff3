"""The oracle service on a real HTTP/2 server (loopback, port 0) over a small synthetic data set:
what each trainer's stream carries, back-pressure, resuming, bad requests, planner failure."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import orjson
import pytest

from common.data.dataset import open_dataset
from common.data.spec import DataSpec
from common.directive import Directive
from common.errors import BadRequest, BagpipeError, ConfigError, Conflict
from common.keys import TableLayout
from common.spec import Endpoint
from common.steps import EndOfStream, TrainBatch, kind_of
from common.transport import H2Client, H2Server, read_messages
from oracle.planner import Planner, PlannerConfig
from oracle.service import OracleService, Workload
from tests.oracle.simulator import plan_incrementally, wire
from tests.prometheus_text import Scrape, parse
from trainer.io_thread import IoThread
from trainer.remote import DirectiveStream

TOKEN = "oracle-test-token"
T = 2
BATCH = 8  # 4 samples per trainer
SPEC = DataSpec(
    format="synthetic", rows=256, table_sizes=(40, 25, 12), num_dense=3, top1_share=0.5, seed=7
)
DATASET = open_dataset(SPEC)
LAYOUT = TableLayout(DATASET.table_sizes)
N = DATASET.num_batches(BATCH)  # 32 iterations
STEP_TIMEOUT_S = 120


def workload(start: int = 0) -> Workload:
    return Workload(
        dataset=DATASET, layout=LAYOUT, batch_size=BATCH, epochs=1, max_iterations=0, start=start
    )


def config(start: int = 0, capacity: int = 16) -> PlannerConfig:
    return PlannerConfig(
        num_trainers=T, lookahead=3, prefetch_lead=2, capacity=capacity, checkpoint_every=5,
        first_iteration=start,
    )


def planned_directly(start: int = 0) -> list[list[Directive]]:
    """What the planner emits on the same batches, without the service."""
    planner = Planner(config(start))
    out = [ds for keys, _, _ in workload(start).key_batches() for ds in planner.push(keys)]
    return out + planner.finish()


@dataclass
class Received:
    """One stream as read: per step its directive, labels, dense and raw messages."""

    directives: list[Directive]
    labels: list[np.ndarray]
    dense: list[np.ndarray]
    raw: list[bytes]
    end: int | None = None  # the end message's iteration count

    @property
    def iterations(self) -> list[int]:
        return [d.iteration for d in self.directives]


@contextlib.asynccontextmanager
async def serving(service: OracleService, *, client_token: str | None = TOKEN) -> AsyncIterator[H2Client]:
    """The service on a loopback port, planning, and a client of it; stopped in order."""
    server = H2Server(service.router(), host="127.0.0.1", port=0, token=TOKEN)
    await server.start()
    service.start()
    client = H2Client("127.0.0.1", server.port, token=client_token, timeout=10)
    try:
        yield client
    finally:
        await client.close()
        service.stop()
        await server.stop()


async def read(
    client: H2Client, trainer: int, start: int, limit: int | None = None, *, ack: bool = True
) -> Received:
    """Read trainer's stream from `start` to its end, or stop after `limit` steps; with
    `ack`, acknowledging each step received, as a trainer does."""
    got = Received([], [], [], [])
    # The first step may wait for numba to compile the planner (over 10 s on a cold cache).
    chunks = client.stream("GET", f"/v1/stream?trainer={trainer}&start={start}", timeout=STEP_TIMEOUT_S)
    async with contextlib.aclosing(chunks), contextlib.aclosing(read_messages(chunks)) as messages:
        pending: TrainBatch | None = None
        async for message in messages:
            got.raw.append(message)
            kind = kind_of(message)
            if kind == "batch":
                pending = TrainBatch.from_wire(message)
            elif kind == "directive":
                d = Directive.from_wire(message)
                assert pending is not None and pending.iteration == d.iteration and d.trainer == trainer
                got.directives.append(d)
                got.labels.append(pending.labels)
                got.dense.append(pending.dense)
                pending = None
                if ack:
                    await client.call("POST", f"/v1/stream/ack?trainer={trainer}&next={d.iteration + 1}")
                if limit is not None and len(got.directives) == limit:
                    break
            else:
                assert kind == "end", kind
                got.end = EndOfStream.from_wire(message).iterations
    return got


async def settled(
    value: Callable[[], float], target: float, *, hold_s: float = 0.3, deadline_s: float = 10.0
) -> float:
    """Poll `value` until it equals `target` and has not changed for `hold_s`; its last value
    at the deadline otherwise."""
    end = time.monotonic() + deadline_s
    last, since = value(), time.monotonic()
    while time.monotonic() < end:
        await asyncio.sleep(0.02)
        now = value()
        if now != last:
            last, since = now, time.monotonic()
        elif now == target and time.monotonic() - since >= hold_s:
            break
    return last


def check_stream(got: Received, trainer: int, start: int = 0) -> None:
    """Byte-identical to the planner's directives; labels and dense are this trainer's rows."""
    expected = planned_directly(start)
    assert got.iterations == list(range(start, N)) and got.end == N
    assert [d.to_wire() for d in got.directives] == [ds[trainer].to_wire() for ds in expected]
    per = BATCH // T
    rows = slice(trainer * per, (trainer + 1) * per)
    for x, batch in zip(range(start, N), DATASET.train_batches(BATCH, start=start), strict=True):
        i = x - start
        assert np.array_equal(got.labels[i], batch.labels[rows])
        assert np.array_equal(got.dense[i], batch.dense[rows])


# --------------------------------------------------------------------------- streaming


async def test_each_trainer_streams_the_planners_directives_and_its_rows() -> None:
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        streams = await asyncio.gather(*(read(client, j, 0) for j in range(T)))
    for j, got in enumerate(streams):
        check_stream(got, j)
    assert [ds[0].iteration for ds in planned_directly() if ds[0].checkpoint] == [4, 9, 14, 19, 24, 29]
    assert service.progress.iterations == N


async def test_planner_workers_stream_the_merged_plan_and_the_same_rows() -> None:
    # P = 2 worker processes behind the service: each trainer's stream carries the plan of
    # the two key partitions merged (what the in-process pool and the reference make), the
    # same labels and dense rows, and every step, though the directives come a batch later
    parallel = dataclasses.replace(config(capacity=32), workers=2)
    expected = wire(plan_incrementally(parallel, [keys for keys, _, _ in workload().key_batches()]))
    service = OracleService(parallel, workload(), max_ahead=4)
    async with serving(service) as client:
        streams = await asyncio.gather(*(read(client, j, 0) for j in range(T)))
    for j, got in enumerate(streams):
        assert got.iterations == list(range(N)) and got.end == N
        assert [d.to_wire() for d in got.directives] == [ds[j] for ds in expected]
        per = BATCH // T
        for i, batch in enumerate(DATASET.train_batches(BATCH)):
            assert np.array_equal(got.labels[i], batch.labels[j * per : (j + 1) * per])
    cpu = service.cpu_by_phase()
    assert cpu["plan_workers"] > 0 and cpu["plan"] > 0  # the workers', then this process's merge


async def test_two_services_send_identical_bytes() -> None:
    raw = []
    for _ in range(2):
        async with serving(OracleService(config(), workload(), max_ahead=4)) as client:
            streams = await asyncio.gather(*(read(client, j, 0) for j in range(T)))
        raw.append([b"".join(s.raw) for s in streams])
    assert raw[0] == raw[1]


async def test_a_trainer_that_reads_nothing_holds_the_planner_max_ahead_ahead() -> None:
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        eager = asyncio.create_task(read(client, 0, 0))  # trainer 1 has not read anything yet
        planned = await settled(lambda: service.progress.iterations, 4)
        assert planned == 4
        assert not eager.done()
        late = await read(client, 1, 0)  # trainer 1 reads: everything flows again
        early = await asyncio.wait_for(eager, 10)
    check_stream(early, 0)
    check_stream(late, 1)


async def scrape(client: H2Client) -> Scrape:
    answer = await client.request("GET", "/metrics")
    assert answer.status == 200
    return parse(answer.body.decode())


async def test_metrics_show_the_planner_held_back_by_the_slowest_trainer() -> None:
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        eager = asyncio.create_task(read(client, 0, 0))  # trainer 1 reads nothing yet
        assert await settled(lambda: service.progress.iterations, 4) == 4
        held = await scrape(client)
        assert held.by_label("bagpipe_steps_ahead", "trainer") == {"0": 0, "1": 4}
        assert held.by_label("bagpipe_trainer_position", "trainer") == {"0": 4, "1": 0}
        assert held.by_label("bagpipe_streams_open", "trainer") == {"0": 1, "1": 0}
        assert held.value("bagpipe_planner_waiting") == 1
        assert held.value("bagpipe_steps_held") == 4 and held.value("bagpipe_run_iterations") == N
        waited = held.value("bagpipe_planner_waiting_seconds_total")
        assert waited > 0 and (await scrape(client)).value("bagpipe_planner_waiting_seconds_total") > waited
        await read(client, 1, 0)
        await eager
        assert await settled(lambda: sum(service.streams_open), 0) == 0
        done = await scrape(client)
    uses = N * BATCH * LAYOUT.num_tables
    assert done.value("bagpipe_iterations_planned_total") == N
    assert done.value("bagpipe_planner_key_uses_total") == uses
    seconds = done.value("bagpipe_planner_seconds_total")
    assert done.value("bagpipe_planner_key_uses_per_second") == pytest.approx(uses / seconds)
    assert done.by_label("bagpipe_steps_ahead", "trainer") == {"0": 0, "1": 0}
    assert done.by_label("bagpipe_trainer_position", "trainer") == {"0": N, "1": N}
    assert done.by_label("bagpipe_streams_open", "trainer") == {"0": 0, "1": 0}
    assert done.by_label("bagpipe_steps_sent_total", "trainer") == {"0": N, "1": N}
    assert done.value("bagpipe_planner_waiting") == 0
    cpu = done.by_label("bagpipe_oracle_cpu_seconds_total", "phase")
    assert set(cpu) == {"read", "plan", "plan_workers", "encode", "serve"}
    assert cpu["plan_workers"] == 0  # P = 1: the planner is this process's
    assert all(cpu[phase] > 0 for phase in ("read", "plan", "encode", "serve"))


# --------------------------------------------------------------------------- resuming


async def test_a_second_stream_resumes_at_the_step_asked_for() -> None:
    service = OracleService(config(), workload(), max_ahead=64)
    async with serving(service) as client:
        first = await read(client, 0, 0, limit=5)
        rest = await read(client, 0, 5)
    assert first.iterations == [0, 1, 2, 3, 4]
    expected = planned_directly()
    both = first.directives + rest.directives
    assert [d.to_wire() for d in both] == [ds[0].to_wire() for ds in expected]
    assert rest.iterations == list(range(5, N)) and rest.end == N


@pytest.mark.parametrize("first", [0, 10])
async def test_an_oracle_restarted_alone_serves_the_same_steps_from_where_each_trainer_is(first: int) -> None:
    """The new process replans from the run's first iteration; trainers that reconnect far
    past `max_ahead` (and at different points) neither hold the planner nor get other bytes."""
    async with serving(OracleService(config(first), workload(first), max_ahead=2)) as client:
        before = await asyncio.gather(read(client, 0, first), read(client, 1, first))
    restarted = OracleService(config(first), workload(first), max_ahead=2, restarted_alone=True)
    async with serving(restarted) as client:
        after = await asyncio.gather(read(client, 0, first + 13), read(client, 1, first + 17))
    for j, (whole, tail) in enumerate(zip(before, after)):
        skip = tail.iterations[0] - first
        assert tail.iterations == list(range(first + 13 + 4 * j, N)) and tail.end == N
        assert tail.raw == whole.raw[2 * skip :]  # batch and directive per step, then the end


async def test_a_start_below_the_oldest_kept_step_answers_409() -> None:
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        await asyncio.gather(*(read(client, j, 0) for j in range(T)))
        answer = await client.request("GET", "/v1/stream?trainer=0&start=0")
        body = orjson.loads(answer.body)
        assert answer.status == 409 and body["error"] == "conflict"
        assert "no longer held" in body["message"] and body["oldest"] == N - 4
        with pytest.raises(Conflict, match="oldest kept"):
            await read(client, 1, N - 5)
        tail = await read(client, 1, N - 4)  # the oldest kept step still streams
    assert tail.iterations == list(range(N - 4, N)) and tail.end == N


async def test_a_stray_reader_past_a_trainer_cannot_make_the_oracle_drop_its_steps() -> None:
    """Trainer 0 read 4 steps and its stream broke; a reader of trainer 0's stream from near
    the run's end neither moves trainer 0's position nor releases the planner, so trainer 1
    can run ahead by `max_ahead` only and trainer 0 resumes where it was."""
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        first = await read(client, 0, 0, limit=4)  # all the planner may make before trainer 1 reads
        stray = asyncio.create_task(read(client, 0, N - 2, ack=False))
        other = asyncio.create_task(read(client, 1, 0))
        assert await settled(lambda: service.progress.iterations, 8) == 8
        assert not stray.done() and not other.done()
        rest = await read(client, 0, 4)
        strayed, late = await asyncio.wait_for(asyncio.gather(stray, other), 10)
    check_stream(Received(first.directives + rest.directives, first.labels + rest.labels,
                          first.dense + rest.dense, first.raw + rest.raw, rest.end), 0)
    check_stream(late, 1)
    assert strayed.iterations == [N - 2, N - 1] and strayed.end == N


async def test_a_second_reader_cannot_take_a_trainers_steps_before_its_first_stream() -> None:
    """Trainer 0's stream from far ahead, before trainer 0 itself connects; trainer 0 then
    streams from the start, whole."""
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        stray = asyncio.create_task(read(client, 0, N - 2, ack=False))
        other = asyncio.create_task(read(client, 1, 0))
        assert await settled(lambda: service.progress.iterations, 4) == 4
        real = await read(client, 0, 0)
        strayed, late = await asyncio.wait_for(asyncio.gather(stray, other), 10)
    check_stream(real, 0)
    check_stream(late, 1)
    assert strayed.iterations == [N - 2, N - 1] and strayed.end == N


async def test_a_reader_that_takes_a_window_of_steps_and_leaves_moves_no_trainer() -> None:
    """The probe's attack: before the trainers start, a client with the token reads one chunk
    of trainer 1's stream from 0 and closes, the steps pushed into its flow-control window
    unread. They do not count as trainer 1's: it then streams from 0, whole, while trainer 0
    runs ahead by `max_ahead` only."""
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        chunks = client.stream("GET", "/v1/stream?trainer=1&start=0", timeout=STEP_TIMEOUT_S)
        async with contextlib.aclosing(chunks):
            assert await anext(chunks)
        assert await settled(lambda: service.buffer.depths().positions[1], 0) == 0  # type: ignore[union-attr]
        eager = asyncio.create_task(read(client, 0, 0))
        assert await settled(lambda: service.progress.iterations, 4) == 4
        late = await read(client, 1, 0)
        early = await asyncio.wait_for(eager, 10)
    check_stream(early, 0)
    check_stream(late, 1)


async def test_a_stream_from_the_runs_end_is_answered_at_once() -> None:
    """A trainer that received every step but the end message asks from the run's length: its
    end message comes at once, though the planner is held by trainers that read nothing."""
    service = OracleService(config(), workload(), max_ahead=4)
    async with serving(service) as client:
        got = await asyncio.wait_for(read(client, 0, N, ack=False), 10)
        assert service.progress.iterations <= 4  # held back: nobody read a step
    assert got.iterations == [] and got.end == N


async def test_a_workload_starting_late_streams_from_its_start() -> None:
    start = 12  # resuming after a planner-side checkpoint at 9 plus two more iterations
    service = OracleService(config(start), workload(start), max_ahead=4)
    async with serving(service) as client:
        with pytest.raises(BadRequest, match=f"'start' must be an integer in {start}\\.\\.{N}"):
            await read(client, 0, 0)
        streams = await asyncio.gather(*(read(client, j, start) for j in range(T)))
    for j, got in enumerate(streams):
        check_stream(got, j, start)
    assert [d.iteration for d in streams[0].directives if d.checkpoint] == [14, 19, 24, 29]


def test_the_service_refuses_a_planner_numbered_differently_from_its_workload() -> None:
    with pytest.raises(ConfigError) as err:
        OracleService(config(3), workload(0), max_ahead=4)
    assert err.value.field == "--first-iteration"
    with pytest.raises(ConfigError, match=r"--first-iteration: must be in 0\.\.32"):
        workload(N + 1)


# --------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("query", "parameter"),
    [
        ("start=0", "trainer"),
        ("trainer=0", "start"),
        ("trainer=x&start=0", "trainer"),
        ("trainer=-1&start=0", "trainer"),
        ("trainer=2&start=0", "trainer"),  # out of range: T = 2
        ("trainer=0&start=abc", "start"),
        ("trainer=0&start=%C2%B2", "start"),  # '²' passes str.isdigit
        (f"trainer=0&start={N + 1}", "start"),  # past the run's end (N alone streams the end)
        ("trainer=0&start=1000000", "start"),
        ("trainer=0&trainer=1&start=0", "trainer"),  # streamed trainer 1
        ("trainer=0&start=0&start=5", "start"),
        # past Python's int-string digit limit
        pytest.param(f"trainer={'9' * 4400}&start=0", "trainer", id="trainer-4400-digits"),
        pytest.param(f"trainer=0&start={'1' * 4400}", "start", id="start-4400-digits"),
    ],
)
async def test_bad_stream_requests_answer_400_naming_the_parameter(query: str, parameter: str) -> None:
    service = OracleService(config(), workload(), max_ahead=64)
    async with serving(service) as client:
        answer = await client.request("GET", f"/v1/stream?{query}")
        body = orjson.loads(answer.body)
        assert answer.status == 400 and body["error"] == "bad_request"
        assert body["parameter"] == parameter and repr(parameter) in body["message"]
        got = await read(client, 1, 0)  # the server keeps serving
    assert got.end == N and len(got.directives) == N


async def test_streams_need_the_token_and_health_and_metrics_do_not() -> None:
    service = OracleService(config(), workload(), max_ahead=64)
    async with serving(service, client_token=None) as anonymous:
        refused = await anonymous.request("GET", "/v1/stream?trainer=0&start=0")
        assert refused.status == 401 and orjson.loads(refused.body)["error"] == "unauthorized"
        health = await anonymous.request("GET", "/v1/health")
        assert health.status == 200
        assert orjson.loads(health.body) | {"planned": 0} == {
            "role": "oracle", "mode": "bagpipe", "trainers": T, "iterations": N, "planned": 0,
        }
        metrics = await anonymous.request("GET", "/metrics")
        assert metrics.status == 200 and metrics.headers["content-type"].startswith("text/plain")
        await settled(lambda: service.progress.iterations, N)
        again = await anonymous.request("GET", "/metrics")
        assert f"bagpipe_iterations_planned_total {N}" in again.body.decode()


# --------------------------------------------------------------------------- failure


async def test_a_planner_failure_fails_the_streams_and_the_service() -> None:
    # C = 2 cannot hold one trainer's rows of one iteration; the start-up check is bypassed.
    service = OracleService(config(capacity=2), workload(), max_ahead=4)
    async with serving(service) as client:
        early = asyncio.create_task(read(client, 0, 0))
        assert service.failed is not None
        error = await asyncio.wait_for(asyncio.shield(service.failed), 10)
        assert isinstance(error, ConfigError) and "infeasible" in str(error)
        with pytest.raises(BagpipeError):
            await asyncio.wait_for(early, 10)
        with pytest.raises(BagpipeError, match="C = 2 is infeasible"):
            await read(client, 1, 0)
        assert (await client.request("GET", "/v1/health")).status == 200


# --------------------------------------------------------------------------- trainer side


def test_directive_streams_of_the_trainers_read_the_real_service() -> None:
    io = IoThread()
    service = OracleService(config(), workload(), max_ahead=4)
    server = H2Server(service.router(), host="127.0.0.1", port=0, token=TOKEN)

    async def start() -> None:
        await server.start()
        service.start()

    io.run(start(), timeout=10)
    streams = [
        DirectiveStream(io, Endpoint(host="127.0.0.1", port=server.port), token=TOKEN, transport="h2",
                        trainer=j, timeout_s=10)
        for j in range(T)
    ]
    try:
        steps = [list(pair) for pair in zip(*streams, strict=True)]  # in lockstep, like trainers
    finally:
        for stream in streams:
            stream.close()
        service.stop()
        io.run(server.stop(), timeout=10)
        io.close()
    expected = planned_directly()
    got = [[s.directive.to_wire() for s in pair] for pair in steps]
    assert got == [[d.to_wire() for d in ds] for ds in expected]
    assert all(stream.iterations == N for stream in streams)
