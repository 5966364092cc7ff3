"""A PS shard restarted alone (DESIGN §9 extended): it comes back with its latest snapshot
and every trainer replays the write-backs the snapshot lacks, in whatever order the
trainers' requests meet it; the shard then holds, serves and snapshots exactly what it would
have without the restart."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest

from common.errors import BagpipeError, Conflict, Restarted
from common.spec import Endpoint
from common.transport import H2Client
from ps.checkpoint import load_snapshot
from ps.client import PsClient
from ps.journal import WriteJournal
from ps.main import restore_own_latest
from ps.protocol import INCARNATION_HEADER, WriteBack, WriteKind
from ps.service import PsService
from ps.store import ShardConfig, ShardStore
from tests.ps.conftest import DIM, LAYOUT, TOKEN, make_server

EVERY = 5
KEYS = np.arange(0, 60, 2, dtype=np.int64)


def make_shard(directory: Path) -> PsService:
    cfg = ShardConfig(shard=0, num_shards=1, layout=LAYOUT, dim=DIM, state_width=1, seed=3, checkpoint_every=EVERY)
    return PsService(ShardStore(cfg), checkpoint_dir=directory / "ps-0", fetch_timeout_s=3)


async def waiting_fetch(service: PsService) -> None:
    while not service._waiters:
        await asyncio.sleep(0.01)


def trainer(endpoint: Endpoint, journal_bytes: int | None = 1 << 20) -> PsClient:
    return PsClient([endpoint], token=TOKEN, dim=DIM, state_width=1,
                    timeout_s=10, retries=20, backoff_s=0.02, journal_bytes=journal_bytes)


class Shard:
    """Shard 0 of a one-shard PS on a loopback port, whose process can die and come back
    alone on the same port (as `launch.py --role ps --rejoin` does)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.service = make_shard(directory)
        self.server = make_server("h2", self.service)

    async def __aenter__(self) -> Shard:
        await self.server.start()
        self.endpoint = Endpoint(host="127.0.0.1", port=self.server.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()

    async def crash_and_rejoin(self) -> None:
        await self.server.stop()
        self.service = make_shard(self.directory)
        restore_own_latest(self.service)
        self.server = make_server("h2", self.service, port=self.endpoint.port)
        await self.server.start()


def rows_for(keys: np.ndarray, version: int, who: int) -> tuple[np.ndarray, np.ndarray]:
    value = (keys[:, None] * 100 + version * 10 + who).astype(np.float32)
    return np.repeat(value, DIM, axis=1), value


async def write(client: PsClient, keys: np.ndarray, version: int, who: int, *, flush: bool = False) -> None:
    rows, state = rows_for(keys, version, who)
    await client.write_back(keys, rows, state, version, flush=flush)


async def iteration(a: PsClient, b: PsClient, v: int, last: np.ndarray) -> None:
    """Trainers a and b hand rows to each other (a row b wrote at v - 1 is a's at v), each
    fetching with the version the planner would ask for; rows of a band are written once
    every 5 iterations, so what was written just before a restart stays unwritten after."""
    own_a, own_b = KEYS[v % 5 :: 5], KEYS[(v + 1) % 5 :: 5]
    fetches = ((a, own_a), (b, own_b))[:: 1 if v % 2 else -1]  # who meets a restart first varies
    await asyncio.gather(*(c.fetch(k, last[k // 2]) for c, k in fetches))
    await asyncio.gather(write(a, own_a, v, 0), write(b, own_b, v, 1))
    last[own_a // 2] = last[own_b // 2] = v
    if (v + 1) % EVERY == 0:
        flushed = KEYS[(v + 2) % 5 :: 5]
        await write(a, flushed, v, 0, flush=True)
        last[flushed // 2] = v
        await asyncio.gather(a.report_checkpoint(v, 0, 2), b.report_checkpoint(v, 1, 2))


async def run_scenario(directory: Path, restart_after: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Twelve iterations of two trainers on one shard, the shard restarted after `restart_after`."""
    async with Shard(directory) as shard:
        a, b = trainer(shard.endpoint), trainer(shard.endpoint)
        last = np.full(len(KEYS), -1, dtype=np.int64)
        try:
            for v in range(12):
                await iteration(a, b, v, last)
                if v == restart_after:
                    await shard.crash_and_rejoin()
            got = await a.fetch(KEYS, last)
            return got.rows, got.versions
        finally:
            await asyncio.gather(a.close(), b.close())


@pytest.mark.parametrize("restart_after", [2, 4, 6, 7, 9])
async def test_a_shard_restarted_alone_ends_as_if_it_never_was(tmp_path: Path, restart_after: int) -> None:
    want_rows, want_versions = await run_scenario(tmp_path / "whole", None)
    got_rows, got_versions = await run_scenario(tmp_path / "restarted", restart_after)
    assert np.array_equal(got_versions, want_versions) and np.array_equal(got_rows, want_rows)
    for c in (4, 9):
        want, _ = load_snapshot(tmp_path / "whole" / "ps-0", c)
        got, _ = load_snapshot(tmp_path / "restarted" / "ps-0", c)
        for name in ("local", "rows", "state", "versions"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), f"checkpoint {c} {name}"


async def test_a_fetch_waits_for_the_other_trainers_replay(tmp_path: Path) -> None:
    """a asks for the row b wrote before the restart: it is served once b has replayed."""
    key = KEYS[:1]
    async with Shard(tmp_path) as shard:
        a, b = trainer(shard.endpoint), trainer(shard.endpoint)
        await write(b, key, 3, 1)
        await shard.crash_and_rejoin()  # no snapshot yet: it comes back empty
        fetch = asyncio.create_task(a.fetch(key, np.array([3])))
        await asyncio.wait_for(waiting_fetch(shard.service), 10)  # a's fetch waits at the new process
        assert not fetch.done()  # version 3 is only in b's journal
        await write(b, KEYS[1:2], 4, 1)  # b's next request finds the restart and replays first
        got = await asyncio.wait_for(fetch, 10)
        assert got.versions.tolist() == [3] and np.array_equal(got.rows, rows_for(key, 3, 1)[0])
        assert b.replayed_rows == 2  # its journal: the row of version 3 and the one of version 4
        await asyncio.gather(a.close(), b.close())


async def test_a_watching_client_replays_before_it_has_anything_to_send(tmp_path: Path) -> None:
    """b waits (at an all-reduce, say) for a, whose fetch needs a row only b's journal holds:
    b's watch notices the restart by itself, or the two would wait for each other."""
    key = KEYS[:1]
    async with Shard(tmp_path) as shard:
        a, b = trainer(shard.endpoint), trainer(shard.endpoint)
        watch = asyncio.create_task(b.watch_restarts(0.05))
        await write(b, key, 3, 1)
        await shard.crash_and_rejoin()
        got = await asyncio.wait_for(a.fetch(key, np.array([3])), 10)
        assert got.versions.tolist() == [3] and b.replayed_rows == 1
        watch.cancel()
        await asyncio.gather(a.close(), b.close())


async def test_without_a_complete_journal_a_restart_is_a_clear_error(tmp_path: Path) -> None:
    async with Shard(tmp_path) as shard:
        client = trainer(shard.endpoint, journal_bytes=0)  # no checkpoints: nothing is kept
        await write(client, KEYS[:2], 0, 0)
        await shard.crash_and_rejoin()
        with pytest.raises(BagpipeError, match="journal .* is incomplete"):
            await write(client, KEYS[:2], 1, 0)
        await client.close()


async def test_a_request_for_another_incarnation_is_refused_and_status_names_the_current(tmp_path: Path) -> None:
    async with Shard(tmp_path) as shard:
        raw = H2Client("127.0.0.1", shard.endpoint.port, token=TOKEN)
        status = orjson.loads(await raw.call("GET", "/v1/status"))
        assert status["incarnation"] == shard.service.incarnation
        with pytest.raises(Restarted) as caught:
            await raw.call("POST", "/v1/checkpoint/snapshot", body=b'{"checkpoint": 4}',
                           headers={INCARNATION_HEADER: "0" * 16})
        assert caught.value.status == 409 and caught.value.fields["incarnation"] == shard.service.incarnation
        assert shard.service.store.last_checkpoint == -1  # nothing was done
        await raw.close()


async def test_a_report_retried_after_its_snapshot_was_written_is_answered_from_disk(tmp_path: Path) -> None:
    async with Shard(tmp_path) as shard:
        client = trainer(shard.endpoint)
        first, = await client.report_checkpoint(4, 0, 1)
        again, = await client.report_checkpoint(4, 0, 1)  # as if the answer had been lost
        assert again.checkpoint == 4 and again.nbytes == first.nbytes > 0
        shutil.rmtree(first.path)
        with pytest.raises(Conflict, match="already taken"):  # taken, but not on disk any more
            await client.report_checkpoint(4, 0, 1)
        await client.close()


def entry(version: int, rows: int = 4) -> WriteBack:
    return WriteBack(kind=WriteKind.EVICT, version=version, keys=np.zeros(rows, np.int64),
                     rows=np.zeros((rows, DIM), np.float32), state=np.zeros((rows, 1), np.float32))


def test_the_journal_keeps_what_no_snapshot_holds() -> None:
    journal = WriteJournal(limit_bytes=1 << 20)
    for v in (1, 3, 4, 6, 4, 8):  # a flush of 4 may follow a write of 6
        journal.record(entry(v))
    journal.forget_through(4)
    assert [e.version for e in journal.entries()] == [6, 8] and journal.complete
    assert journal.nbytes == 2 * entry(0).nbytes and journal.peak_nbytes == 6 * entry(0).nbytes


def test_past_its_limit_the_journal_is_incomplete_until_a_snapshot_covers_the_loss() -> None:
    journal = WriteJournal(limit_bytes=3 * entry(0).nbytes)
    for v in range(4):
        journal.record(entry(v))
    assert not journal.complete and len(journal) == 0
    journal.record(entry(4))
    journal.forget_through(2)
    assert not journal.complete  # version 3 was dropped and no snapshot holds it
    journal.forget_through(4)
    assert journal.complete and len(journal) == 0
