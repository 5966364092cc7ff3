"""A PS shard restarted alone (docs/design.md#a-ps-shard-restarted-alone): it comes back with its latest snapshot
and every trainer replays the write-backs the snapshot lacks, in whatever order the
trainers' requests meet it, then reports that it has; the shard serves no fetch until every
trainer has, and then holds, serves and snapshots exactly what it would have without the
restart."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from common.checkpoints import checkpoint_name
from common.errors import BagpipeError, Conflict, Restarted, TimedOut
from common.spec import Endpoint
from common.transport import H2Client
from ps.checkpoint import list_checkpoints, load_snapshot, save_snapshot
from ps.client import PsClient
from ps.journal import WriteJournal
from ps.protocol import INCARNATION_HEADER, WriteBack, WriteKind
from ps.relaunch import shard_command
from ps.service import PsService
from ps.startup import restore_own_latest, start_fresh
from ps.store import ShardConfig, ShardStore
from tests.ps.conftest import DIM, LAYOUT, TOKEN, make_server, until

EVERY = 5
KEYS = np.arange(0, 60, 2, dtype=np.int64)


def make_shard(directory: Path, rejoin_trainers: int = 0) -> PsService:
    cfg = ShardConfig(shard=0, num_shards=1, layout=LAYOUT, dim=DIM, state_width=1, seed=3, checkpoint_every=EVERY)
    return PsService(ShardStore(cfg), checkpoint_dir=directory / "ps-0", fetch_timeout_s=3,
                     rejoin_trainers=rejoin_trainers)


async def waiting_fetch(service: PsService) -> None:
    await until(lambda: service.fetches_waiting)


def trainer(
    endpoint: Endpoint, rank: int, journal_bytes: int | None = 1 << 20, resumed_from: int = -1, trainers: int = 2,
    coordinator: Endpoint | None = None,
) -> PsClient:
    """Trainer `rank` of `trainers`'s PS client, as `trainer.main` makes it."""
    return PsClient([endpoint], token=TOKEN, dim=DIM, state_width=1, timeout_s=10, retries=20,
                    backoff_s=0.02, journal_bytes=journal_bytes, resumed_from=resumed_from,
                    trainer=rank, trainers=trainers, coordinator=coordinator)


def tool(endpoint: Endpoint) -> PsClient:
    """A client that is not a trainer (tools, benchmarks): no journal, no rank."""
    return PsClient([endpoint], token=TOKEN, dim=DIM, state_width=1, timeout_s=10, retries=20, backoff_s=0.02)


class Shard:
    """Shard 0 of a one-shard PS on a loopback port, whose process can die and come back
    alone on the same port (as `launch.py --role ps --rejoin` does, for a job of `trainers`)."""

    def __init__(self, directory: Path, trainers: int = 2) -> None:
        self.directory = directory
        self.trainers = trainers
        self.service = make_shard(directory)
        self.server = make_server("h2", self.service)

    async def __aenter__(self) -> Shard:
        await self.server.start()
        self.endpoint = Endpoint(host="127.0.0.1", port=self.server.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()

    async def crash_and_rejoin(self) -> None:
        await self.crash_and_restart(rejoin=True)

    async def crash_and_restart(self, *, rejoin: bool) -> None:
        """The process dies and a new one starts on the same port: with its own latest
        snapshot (`--rejoin`: it holds fetches until every trainer replayed), or empty (a
        careless restart)."""
        await self.server.stop()
        self.service = make_shard(self.directory, rejoin_trainers=self.trainers if rejoin else 0)
        if rejoin:
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
        a, b = trainer(shard.endpoint, 0), trainer(shard.endpoint, 1)
        last = np.full(len(KEYS), -1, dtype=np.int64)
        try:
            for v in range(12):
                await iteration(a, b, v, last)
                if v == restart_after:
                    await shard.crash_and_rejoin()
                    assert shard.service.rejoin_waits_for == (0, 1)
            got = await a.fetch(KEYS, last)
            # The restarted shard served fetches only because both trainers reported.
            assert shard.service.rejoin_waits_for == ()
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
        a, b = trainer(shard.endpoint, 0), trainer(shard.endpoint, 1)
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
        a, b = trainer(shard.endpoint, 0), trainer(shard.endpoint, 1)
        watch = asyncio.create_task(b.watch_restarts(0.05))
        await write(b, key, 3, 1)
        await shard.crash_and_rejoin()
        got = await asyncio.wait_for(a.fetch(key, np.array([3])), 10)
        assert got.versions.tolist() == [3] and b.replayed_rows == 1
        watch.cancel()
        await asyncio.gather(a.close(), b.close())


async def test_a_fetch_for_any_version_waits_until_every_trainer_has_replayed(tmp_path: Path) -> None:
    """The row b wrote at version 8 is not in the snapshot of checkpoint 4: a fetch that asks
    for any version (as the oracle does for write-backs known acknowledged) must not get the
    snapshot's copy; it is held until b has replayed and reported, then gets b's row."""
    key = KEYS[:1]
    async with Shard(tmp_path) as shard:
        a, b = trainer(shard.endpoint, 0), trainer(shard.endpoint, 1)
        await write(b, key, 3, 1, flush=False)
        await asyncio.gather(a.report_checkpoint(4, 0, 2), b.report_checkpoint(4, 1, 2))
        await write(b, key, 8, 1)
        await shard.crash_and_rejoin()
        assert shard.service.restored == 4
        fetch = asyncio.create_task(a.fetch(key))  # a finds the restart, replays its nothing, reports
        await asyncio.wait_for(waiting_fetch(shard.service), 10)
        assert shard.service.rejoin_waits_for == (1,) and a.replayed_rows == 0
        _, pending = await asyncio.wait({fetch}, timeout=0.2)
        assert fetch in pending  # the snapshot holds version 3 of the row: not served
        await write(b, KEYS[1:2], 9, 1)  # b's next request finds the restart: replay, report
        got = await asyncio.wait_for(fetch, 10)
        assert got.versions.tolist() == [8] and np.array_equal(got.rows, rows_for(key, 8, 1)[0])
        assert shard.service.rejoin_waits_for == () and b.replayed_rows == 2
        await asyncio.gather(a.close(), b.close())


async def test_a_trainer_that_never_spoke_with_the_restarted_shard_reports_on_first_contact(tmp_path: Path) -> None:
    """b had sent nothing to the shard before it restarted, so it has nothing to replay and
    no restart to notice: it reports on its first contact (a request, or its watch), or the
    shard would hold every fetch for ever."""
    key = KEYS[:1]
    async with Shard(tmp_path) as shard:
        a = trainer(shard.endpoint, 0)
        await write(a, key, 3, 0)
        await shard.crash_and_rejoin()
        b = trainer(shard.endpoint, 1)
        fetch = asyncio.create_task(b.fetch(key))  # first contact: b reports, then waits for a
        await asyncio.wait_for(waiting_fetch(shard.service), 10)
        assert shard.service.rejoin_waits_for == (0,) and not fetch.done()
        watch = asyncio.create_task(a.watch_restarts(0.05))  # a notices the restart by itself
        got = await asyncio.wait_for(fetch, 10)
        assert got.versions.tolist() == [3] and shard.service.rejoin_waits_for == ()
        assert a.replayed_rows == 1 and b.replayed_rows == 0
        watch.cancel()
        await shard.crash_and_rejoin()  # again; c starts only a watch, and has never sent anything
        c = trainer(shard.endpoint, 1)
        watch = asyncio.create_task(c.watch_restarts(0.05))
        got = await asyncio.wait_for(a.fetch(key), 10)  # a's report and c's watch's open it
        assert got.versions.tolist() == [3] and shard.service.rejoin_waits_for == ()  # replayed again
        assert a.replayed_rows == 2 and c.replayed_rows == 0
        watch.cancel()
        await asyncio.gather(a.close(), b.close(), c.close())


async def test_a_tool_reports_nothing_and_a_held_fetch_names_the_trainers_missing(tmp_path: Path) -> None:
    async with Shard(tmp_path) as shard:
        a = trainer(shard.endpoint, 0)
        await write(a, KEYS[:2], 3, 0)
        await shard.crash_and_rejoin()
        probe = tool(shard.endpoint)
        with pytest.raises(TimedOut, match="PS shard 0 restarted alone: trainers 0, 1 have not replayed "
                                           r"their write-backs within 0.3 s") as caught:
            await probe.fetch(KEYS[:2], wait_s=0.3)
        assert caught.value.fields["trainers_missing"] == [0, 1]
        assert shard.service.rejoin_waits_for == (0, 1) and not shard.service.fetches_waiting
        await write(a, KEYS[2:3], 4, 0)  # a replays and reports
        with pytest.raises(TimedOut, match="trainer 1 has not replayed their write-backs within 0.3 s"):
            await probe.fetch(KEYS[:2], wait_s=0.3)
        assert shard.service.rejoin_waits_for == (1,)
        await asyncio.gather(a.close(), probe.close())


async def test_a_shard_that_came_back_empty_is_refused_at_once_and_never_snapshots(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Restarted without --rejoin after checkpoint 4: replaying the journals (writes after 4)
    into an empty shard would lose rows. Every request fails at once naming the shard and the
    commands that recover, instead of waiting for rows that never come; no trainer reports
    to that process, so it never takes a checkpoint. The restart watcher gives up on that
    shard, saying so once, and goes on watching."""
    async with Shard(tmp_path) as shard:
        a, b = trainer(shard.endpoint, 0), trainer(shard.endpoint, 1)
        watch = asyncio.create_task(b.watch_restarts(0.05))
        last = np.full(len(KEYS), -1, dtype=np.int64)
        for v in range(7):
            await iteration(a, b, v, last)
        await shard.crash_and_restart(rejoin=False)
        started = time.monotonic()
        for call in (a.fetch(KEYS, last), b.report_checkpoint(9, 1, 2), write(a, KEYS[:2], 7, 0)):
            with pytest.raises(Conflict) as refused:
                await asyncio.wait_for(call, 10)
            message = refused.value.message
            assert "PS shard 0" in message and "came back empty" in message, message
            assert "--role ps --index 0 --rejoin" in message and "--resume" in message, message
            assert refused.value.fields["needs"] == 4
        assert time.monotonic() - started < 5  # not the fetch timeout, nor a retry budget
        assert a.replayed_rows == b.replayed_rows == 0 and shard.service.store.max_version == -1
        assert shard.service.store.last_checkpoint == -1 and list_checkpoints(shard.directory / "ps-0") == [4]
        def given_up() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot rejoin PS shard 0")]

        await until(given_up, timeout=10)
        await asyncio.sleep(0.2)  # four more rounds of the watch: it does not try that shard again
        assert len(given_up()) == 1 and not watch.done()
        watch.cancel()
        await asyncio.gather(a.close(), b.close())


async def test_a_shard_rejoining_from_a_snapshot_older_than_the_journals_is_refused(tmp_path: Path) -> None:
    async with Shard(tmp_path) as shard:
        a, b = trainer(shard.endpoint, 0), trainer(shard.endpoint, 1)
        last = np.full(len(KEYS), -1, dtype=np.int64)
        for v in range(11):
            await iteration(a, b, v, last)
        shutil.rmtree(tmp_path / "ps-0" / checkpoint_name(9))  # its newest snapshot is lost
        await shard.crash_and_rejoin()
        assert shard.service.restored == 4
        with pytest.raises(Conflict, match="came back with checkpoint 4 .* after checkpoint 9"):
            await asyncio.wait_for(a.fetch(KEYS, last), 10)
        await asyncio.gather(a.close(), b.close())


async def test_a_resumed_trainer_refuses_a_shard_that_did_not_resume(tmp_path: Path) -> None:
    """Trainers resumed from checkpoint 9; the shard was started empty (as with --fresh)."""
    async with Shard(tmp_path) as shard:
        client = trainer(shard.endpoint, 0, resumed_from=9)
        with pytest.raises(Conflict, match="PS shard 0 .* came back empty .* after checkpoint 9"):
            await asyncio.wait_for(client.fetch(KEYS[:2]), 10)
        await client.close()
        resumed = trainer(shard.endpoint, 0, resumed_from=-1)  # a new run's trainer takes it
        assert (await resumed.fetch(KEYS[:2])).versions.tolist() == [-1, -1]
        await resumed.close()


def test_a_shard_started_without_flags_over_snapshots_refuses_naming_the_commands(tmp_path: Path) -> None:
    service = make_shard(tmp_path)
    save_snapshot(service.checkpoint_dir, 4, service.store.snapshot(4), {})
    with pytest.raises(Conflict) as refused:
        start_fresh(service, 0, delete=False)
    message = refused.value.message
    assert "--role ps --index 0 --rejoin" in message and "--resume" in message and "--fresh" in message
    assert list_checkpoints(service.checkpoint_dir) == [4]  # nothing deleted
    start_fresh(service, 0, delete=True)  # --fresh: a new run
    assert list_checkpoints(service.checkpoint_dir) == [] and service.restored == -1
    start_fresh(make_shard(tmp_path / "new"), 0, delete=False)  # nothing on disk: a new run anyway


def test_a_shard_joined_through_the_coordinator_is_told_the_command_it_was_started_with(tmp_path: Path) -> None:
    """It was told the spec's form, which a shard that has no spec cannot run."""
    service = make_shard(tmp_path)
    save_snapshot(service.checkpoint_dir, 4, service.store.snapshot(4), {})
    here, oracle = Endpoint(host="10.0.0.5", port=7001), Endpoint(host="10.0.0.1", port=7000)
    with pytest.raises(Conflict) as refused:
        start_fresh(service, 0, delete=False, command=shard_command(0, oracle, here))
    message = refused.value.message
    assert "`python launch.py --role ps --coordinator 10.0.0.1:7000 --index 0 --bind 10.0.0.5:7001 --rejoin`" in message
    assert "SPEC" not in message


async def test_a_trainer_joined_through_the_coordinator_names_the_joined_command(tmp_path: Path) -> None:
    """A shard that came back empty under a joined job: the trainer's error gives the
    command through the coordinator, on the shard's address, never the spec's form."""
    oracle = Endpoint(host="10.0.0.1", port=7000)
    async with Shard(tmp_path) as shard:
        client = trainer(shard.endpoint, 0, resumed_from=9, coordinator=oracle)
        with pytest.raises(Conflict) as refused:
            await asyncio.wait_for(client.fetch(KEYS[:2]), 10)
        message = refused.value.message
        expected = f"`python launch.py --role ps --coordinator 10.0.0.1:7000 --index 0 --bind {shard.endpoint} --rejoin`"
        assert expected in message and "SPEC" not in message, message
        await client.close()


async def test_without_a_complete_journal_a_restart_is_a_clear_error(tmp_path: Path) -> None:
    async with Shard(tmp_path, trainers=1) as shard:
        client = trainer(shard.endpoint, 0, journal_bytes=0, trainers=1)  # no checkpoints: nothing is kept
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
    async with Shard(tmp_path, trainers=1) as shard:
        client = trainer(shard.endpoint, 0, trainers=1)
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


def test_the_journal_needs_the_checkpoint_it_starts_after() -> None:
    """The lineage rule (sans-IO): a shard process holding checkpoint r can be replayed into
    only if r >= needs, the newest checkpoint the journal was trimmed to or resumed from,
    or the newest version it dropped over its limit."""
    journal = WriteJournal(limit_bytes=3 * entry(0).nbytes)
    assert journal.needs == -1  # a new run: an empty shard is whole once replayed into
    journal.record(entry(3))
    journal.forget_through(4)
    assert journal.needs == 4 and journal.base == 4
    assert WriteJournal(1 << 20, base=9).needs == 9  # a resumed trainer: every shard holds 9
    for v in range(5, 9):
        journal.record(entry(v))  # over the limit at the fourth: 5..8 dropped
    assert journal.needs == 8 and not journal.complete
    journal.forget_through(9)
    assert journal.needs == 9 and journal.complete


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
