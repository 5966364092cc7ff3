"""Client of all PS shards: splits keys by shard and talks to every shard concurrently.

One long-lived connection per shard (HTTP/2 multiplexes every request on it). Calls that
fail because a shard is unreachable are retried with exponential backoff (at least
`retries` times and for at least `reconnect_s`), then raise `Unavailable` naming the shard;
errors the shard answered (4xx) are raised at once.

A shard may be restarted alone from its latest snapshot while its clients wait. Each
request names the shard process (incarnation) the client last spoke with; a restarted shard
refuses it (409 ``restarted``), and a client keeping a journal (trainers) then replays the
write-backs the shard's snapshot lacks before going on. A trainer's client then reports to
the new process that it has replayed (`ps.protocol.Rejoined`), as it does on first contact
with a shard that waits for it: a shard restarted alone serves no fetch until every trainer
has, or it could serve a row older than a write-back still in a journal. Retried
write-backs are sent as replays: one that had landed before the connection broke changes
nothing.

A client with a journal speaks only with shard processes that journal can make whole: on
first contact and after each restart it reads the checkpoint the shard's rows descend from
(`ShardStatus.restored`) and refuses, with 409 naming the shard and the commands that recover,
one that holds less than the journal needs (`WriteJournal.needs`): a shard that came back
empty, or from an older snapshot. Since a shard snapshots checkpoint c only once every
trainer reported c to that very process, such a shard never completes a checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import numpy as np

from common.errors import BagpipeError, Conflict, Regrouped, Restarted, TimedOut, Unavailable, WireError
from common.keys import split_by_shard
from common.spec import Endpoint, Transport
from common.transport import Tls, connect_client
from common.transport.retry import RetryBudget
from ps.journal import WriteJournal
from ps.relaunch import shard_command
from ps.protocol import (
    FETCH,
    INCARNATION_HEADER,
    REJOINED,
    REPORT_CHECKPOINT,
    RESTORE,
    SNAPSHOT,
    STATUS,
    WRITE_BACK,
    CheckpointReport,
    CheckpointSaved,
    FetchRequest,
    Message,
    Rejoined,
    RejoinProgress,
    Restored,
    RestoreRequest,
    Route,
    Rows,
    ShardStatus,
    SnapshotRequest,
    WriteBack,
    WriteKind,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


class PsClient:
    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        token: str,
        dim: int,
        state_width: int,
        transport: Transport = "h2",
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.1,
        reconnect_s: float = 0.0,
        journal_bytes: int | None = None,
        resumed_from: int = -1,
        trainer: int | None = None,
        trainers: int = 0,
        tls: Tls | None = None,
        coordinator: Endpoint | None = None,
        term: int = 0,
    ) -> None:
        """`coordinator`: where the shards joined, if they did (the recovery commands this
        client's errors give then go through it). `resumed_from`: the checkpoint this client's run resumed from (-1: none), which
        every shard must hold. `trainer` (of `trainers`): the trainer this client writes for,
        which reports to a shard restarted alone once it has replayed to it; None: not a
        trainer (tools, benchmarks), which reports nothing."""
        if trainer is not None and not 0 <= trainer < trainers:
            raise ValueError(f"trainer {trainer} is not in 0..{trainers - 1}")
        self.endpoints = tuple(endpoints)
        self.coordinator = coordinator
        self.term = term
        self.trainer = trainer
        self.trainers = trainers
        self.dim = dim
        self.state_width = state_width
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.reconnect_s = reconnect_s
        # None: this client writes nothing a restarted shard would miss (tools, benchmarks).
        self.journals = (
            None if journal_bytes is None
            else [WriteJournal(journal_bytes, base=resumed_from) for _ in endpoints]
        )
        self.replayed_rows = 0
        self._clients = [
            connect_client(transport, e.host, e.port, token=token, timeout=timeout_s, tls=tls) for e in endpoints
        ]
        self._incarnations: list[str | None] = [None] * len(self.endpoints)
        self._rejoining = [asyncio.Lock() for _ in endpoints]

    @property
    def num_shards(self) -> int:
        return len(self.endpoints)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients))

    async def fetch(
        self,
        keys: np.ndarray,
        min_versions: np.ndarray | None = None,
        *,
        wait_s: float | None = None,
        out: Rows | None = None,
    ) -> Rows:
        """Rows of `keys` once each has reached its min_version (default: any version); a
        shard waits up to `wait_s` (default: its own limit) for a version to arrive. `out`:
        where to write them (arrays of the right shapes: the trainer's shared memory, say)."""
        keys = np.asarray(keys, dtype=np.int64)
        if min_versions is None:
            min_versions = np.full(len(keys), -1, dtype=np.int64)
        min_versions = np.asarray(min_versions, dtype=np.int64)
        if out is None:
            out = Rows(
                rows=np.empty((len(keys), self.dim), np.float32),
                state=np.empty((len(keys), self.state_width), np.float32),
                versions=np.empty(len(keys), np.int64),
            )
        # A fetch may wait at the PS for a write-back: give the HTTP call that much longer.
        timeout = self.timeout_s + (wait_s or 0.0)
        wait = wait_s or None  # 0 or None: the shard's own limit

        async def one(shard: int, pos: np.ndarray) -> None:
            request = FetchRequest(keys=keys[pos], min_versions=min_versions[pos], wait_s=wait)
            got = Rows.from_wire(await self._call(shard, FETCH, request, timeout))
            if len(got.versions) != len(pos):
                n = len(got.versions)
                raise WireError(f"PS shard {shard} answered {n} rows for {len(pos)} keys")
            out.rows[pos] = got.rows
            out.state[pos] = got.state
            out.versions[pos] = got.versions

        await self._each_shard(keys, one)
        return out

    async def write_back(
        self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, *, flush: bool = False
    ) -> None:
        """Store rows with `version` on their shards; each shard applies its part atomically.
        A `flush` is checkpoint `version`'s copy of rows that stay cached; otherwise the rows
        were evicted."""
        keys = np.asarray(keys, dtype=np.int64)
        kind = WriteKind.FLUSH if flush else WriteKind.EVICT

        async def one(shard: int, pos: np.ndarray) -> None:
            entry = WriteBack(
                kind=kind, version=version, keys=np.take(keys, pos),
                rows=np.take(rows, pos, axis=0), state=np.take(state, pos, axis=0),
            )
            if self.journals is not None:
                self.journals[shard].record(entry)
            retry = replace(entry, replay=True)
            await self._call(shard, WRITE_BACK, entry, self.timeout_s, retry=retry)

        await self._each_shard(keys, one)

    async def report_checkpoint(
        self, checkpoint_id: int, trainer: int, trainers: int, prune_before: int = -1
    ) -> list[CheckpointSaved]:
        """Tell every shard that `trainer`'s writes up to `checkpoint_id` are acknowledged;
        returns once each shard has written the checkpoint (all trainers reported). Shards
        then delete their snapshots older than `prune_before` (if positive)."""
        report = CheckpointReport(checkpoint=checkpoint_id, trainer=trainer, trainers=trainers,
                                  prune_before=prune_before)
        answers = await self._all_shards(REPORT_CHECKPOINT, report, CheckpointSaved)
        for journal in self.journals or ():
            journal.forget_through(checkpoint_id)
        return answers

    async def snapshot(self, checkpoint_id: int) -> list[CheckpointSaved]:
        """Every shard persists its rows now, as checkpoint `checkpoint_id`, without waiting
        for reports (the final tables)."""
        request = SnapshotRequest(checkpoint=checkpoint_id)
        return await self._all_shards(SNAPSHOT, request, CheckpointSaved)

    async def restore(self, checkpoint_id: int) -> list[Restored]:
        return await self._all_shards(RESTORE, RestoreRequest(checkpoint=checkpoint_id), Restored)

    async def status(self) -> list[ShardStatus]:
        return [
            ShardStatus.from_wire(await self._call(s, STATUS, None, self.timeout_s))
            for s in range(self.num_shards)
        ]

    async def _all_shards(self, route: Route, message: Message, answer: type[M]) -> list[M]:
        bodies = await asyncio.gather(
            *(self._call(s, route, message, self.timeout_s) for s in range(self.num_shards))
        )
        return [answer.from_wire(body) for body in bodies]

    async def _each_shard(self, keys: np.ndarray, one: Callable[[int, np.ndarray], Awaitable[None]]) -> None:
        parts = [(s, pos) for s, pos in enumerate(split_by_shard(keys, self.num_shards)) if len(pos)]
        if len(parts) == 1:
            await one(*parts[0])  # one shard asked (a small batch mostly): no task needed
        else:
            await asyncio.gather(*(one(s, pos) for s, pos in parts))

    async def _call(
        self,
        shard: int,
        route: Route,
        message: Message | None,
        timeout: float,
        *,
        retry: Message | None = None,
    ) -> bytes:
        """The answer body of one request to one shard, retried while the shard is
        unreachable (as `retry` after the first attempt, if given) and replayed to after it
        restarted."""
        budget = RetryBudget(self.retries, self.reconnect_s, self.backoff_s)
        attempts = 0
        while True:
            sent = message if attempts == 0 or retry is None else retry
            attempts += 1
            try:
                incarnation = await self._incarnation(shard)
                try:
                    return await self._clients[shard].call(
                        route.method,
                        route.path,
                        body=b"" if sent is None else sent.to_parts(),
                        headers={INCARNATION_HEADER: incarnation},
                        timeout=timeout,
                    )
                except Restarted:
                    await self._rejoin(shard, incarnation)
            except TimedOut as exc:
                raise TimedOut(f"PS shard {shard} at {self.endpoints[shard]}: {exc.message}",
                               **{**exc.fields, "shard": shard}) from exc
            except Unavailable as exc:
                if not budget.allows_retry():
                    raise Unavailable(
                        f"PS shard {shard} at {self.endpoints[shard]}: {exc.message} "
                        f"(after {budget.failures + 1} attempts in {budget.waited_s:.1f} s)",
                        shard=shard,
                    ) from exc
                log.warning("PS shard %d %s failed (%s); retrying in %.2f s",
                            shard, route.path, exc.message, budget.delay)
                await budget.wait()

    async def watch_restarts(self, interval_s: float) -> None:
        """Until cancelled, notice a shard that restarted even while this client has nothing
        to send it, and replay to it at once: another trainer may be waiting for rows that
        only this client's journal holds, and this one may be waiting for that trainer. A shard
        this client cannot rejoin is left to the next request to it, which fails the same way;
        the others are still watched."""
        given_up: set[int] = set()
        while True:
            await asyncio.sleep(interval_s)
            for shard, known in enumerate(self._incarnations):
                if shard in given_up:
                    continue
                try:
                    if known is None:  # not spoken with yet: a shard restarted alone may wait for it
                        await self._incarnation(shard)
                    elif (await self._status(shard)).incarnation != known:
                        await self._rejoin(shard, known)
                except (Unavailable, TimedOut):
                    continue  # down, or restarting: look again later
                except Regrouped:
                    raise  # this trainer's term is over
                except BagpipeError as exc:  # the next request to that shard meets it too
                    log.error("cannot rejoin PS shard %d: %s", shard, exc.message)
                    given_up.add(shard)

    async def _incarnation(self, shard: int) -> str:
        """The shard process this client speaks with (asked once, then after each restart)."""
        known = self._incarnations[shard]
        if known is not None:
            return known
        # One first contact at a time, and none during a rejoin: a second one could meet a
        # process restarted since the first and take it for the one the first one wrote to.
        async with self._rejoining[shard]:
            known = self._incarnations[shard]
            if known is not None:
                return known
            status = await self._status(shard)
            # Nothing was sent to the shard yet: only what the run resumed from must be there.
            if self.journals is not None:
                journal = self.journals[shard]
                self._check_lineage(shard, status, journal, journal.base)
            if self.trainer in status.rejoin_waits_for:  # restarted alone: nothing to replay
                try:
                    await self._report_rejoined(shard, status.incarnation)
                except Restarted as exc:  # restarted again meanwhile: the next attempt starts over
                    raise Unavailable(f"restarted again during the first contact: {exc.message}") from exc
            known = self._incarnations[shard] = status.incarnation
            return known

    async def _status(self, shard: int) -> ShardStatus:
        """Shard `shard`'s status; Regrouped when it serves another term of an elastic job
        (this client's is over: nothing it holds may be written to that shard)."""
        body = await self._clients[shard].call(STATUS.method, STATUS.path, timeout=self.timeout_s)
        status = ShardStatus.from_wire(body)
        if status.term != self.term:
            raise Regrouped(f"PS shard {shard} at {self.endpoints[shard]} serves term {status.term} of the job, "
                            f"this trainer's is {self.term}", shard=shard)
        return status

    async def _rejoin(self, shard: int, seen: str) -> None:
        """Shard `shard` restarted since `seen`: replay this client's journal to it and, for
        a trainer, report that it did, once."""
        async with self._rejoining[shard]:
            if self._incarnations[shard] != seen:
                return  # another call rejoined already
            current = await self._status(shard)
            journal = self.journals[shard] if self.journals is not None else None
            if journal is not None:
                self._check_lineage(shard, current, journal, journal.needs)
            entries = journal.entries() if journal is not None else []
            rows = sum(len(e.keys) for e in entries)
            log.warning("PS shard %d restarted: replaying %d write-backs (%d rows) to it", shard, len(entries), rows)
            headers = {INCARNATION_HEADER: current.incarnation}
            try:
                for entry in entries:
                    await self._clients[shard].call(
                        WRITE_BACK.method,
                        WRITE_BACK.path,
                        body=replace(entry, replay=True).to_parts(),
                        headers=headers,
                        timeout=self.timeout_s,
                    )
                self.replayed_rows += rows  # counted before the report lets the shard serve them
                await self._report_rejoined(shard, current.incarnation)
            except Restarted as exc:  # restarted again meanwhile: the next attempt starts over
                raise Unavailable(f"restarted again during the replay: {exc.message}") from exc
            self._incarnations[shard] = current.incarnation

    async def _report_rejoined(self, shard: int, incarnation: str) -> None:
        """Tell shard process `incarnation` that this trainer has replayed its journal to it:
        restarted alone, it serves no fetch until every trainer has. Not a trainer: nothing."""
        if self.trainer is None:
            return
        report = Rejoined(trainer=self.trainer, trainers=self.trainers)
        body = await self._clients[shard].call(
            REJOINED.method,
            REJOINED.path,
            body=report.to_parts(),
            headers={INCARNATION_HEADER: incarnation},
            timeout=self.timeout_s,
        )
        progress = RejoinProgress.from_wire(body)
        if progress.waiting:
            log.info("PS shard %d restarted alone: replayed to it; %d of %d trainers have, it "
                     "serves fetches once the others have too", shard, progress.reported, self.trainers)

    def _check_lineage(self, shard: int, status: ShardStatus, journal: WriteJournal, needs: int) -> None:
        """Refuse a shard process whose rows do not reach checkpoint `needs`: `journal`
        could not complete them."""
        if status.restored >= needs:
            return
        where = f"PS shard {shard} at {self.endpoints[shard]}"
        if needs > journal.base:  # what is missing was dropped over the journal's limit
            raise Conflict(
                f"{where} restarted, and this client's journal of the write-backs its snapshot lacks is "
                f"incomplete (over {journal.limit_bytes} bytes, or no checkpoint is taken): only a restart "
                "of every role from the latest complete checkpoint (--resume) can recover",
                shard=shard,
            )
        held = "empty" if status.restored < 0 else f"with checkpoint {status.restored}"
        raise Conflict(
            f"{where} came back {held} (process {status.incarnation}), but this trainer's journal only holds "
            f"the write-backs after checkpoint {needs}: the rows written up to it would be lost (was it "
            "started without --rejoin?). Stop that shard and restart it with "
            f"`{shard_command(shard, self.coordinator, self.endpoints[shard])} --rejoin` (it reloads its own latest snapshot), "
            "or, if its snapshots are gone, stop every role and start each with --resume",
            shard=shard,
            restored=status.restored,
            needs=needs,
        )
