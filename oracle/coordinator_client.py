"""Joining a job through its coordinator (the oracle): the one address a PS shard or a
trainer needs.

A role started with ``--coordinator HOST:PORT`` and the token registers with the oracle:
``POST /v1/register`` with its role, its index (or none: the oracle assigns the lowest
free one) and the address it serves on, and gets back the job (`Joined`): the spec
document, the facts of the data, the PS shards' addresses and, for trainers, where their
process group meets. A trainer's registration is answered once every PS shard has
registered. The messages and routes are in `oracle.protocol`; the oracle's side is
`oracle.coordinator_service`.

This is the coordinator's client side, for the roles that join (PS shards, trainers): it
loads nothing of the oracle's server side (`tests/common/test_layering.py`).

A role that also has the spec file must have the very same document: a role of another job
is refused (409) rather than trained with the wrong tables. Another run's token is refused
(401) before anything else.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from common.errors import Regrouped, TimedOut, Unauthorized, Unavailable
from common.spec import TOKEN_ENV, ClusterSpec, Endpoint
from common.transport import Tls, TransportKind, connect_client
from common.transport.retry import RetryBudget
from oracle.protocol import (
    COMPLETE_CHECKPOINT,
    DENSE,
    HEALTH,
    INGEST,
    PRESENCE,
    REGISTER,
    REGISTER_HOLD_S,
    RESUME_POINT,
    STOP,
    CheckpointCompleted,
    DenseCheckpoint,
    DenseRequest,
    IngestBody,
    IngestReceipt,
    Joined,
    Presence,
    PresenceAnswer,
    Registration,
    ResumePoint,
    Role,
    ask,
    fingerprint,
)

log = logging.getLogger(__name__)
#: How often a role of an elastic job tells the coordinator it is alive (`Presence`).
PRESENCE_EVERY_S = 0.5


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

    async def join(self, role: Role, index: int | None, address: Endpoint, *,
                   left: tuple[int, int] | None = None) -> Joined:
        """Register, asking again while the coordinator is unreachable or still waits for
        the PS shards, for up to `reconnect_s`; then Unavailable naming it. `left`: the
        (term, index) this trainer had in an elastic job that has regrouped since. While an
        elastic job holds the registration (it regroups, or this trainer waits to join it) it
        asks again for as long as that lasts."""
        last_term, last_index = left if left is not None else (None, None)
        registration = Registration(role=role, index=index, address=address, fingerprint=self._fingerprint,
                                    last_term=last_term, last_index=last_index,
                                    nonce=secrets.token_hex(8) if role == "trainer" else None)
        budget = RetryBudget(retries=3, window_s=self.reconnect_s, first_delay_s=0.2)
        while True:
            try:
                return await ask(self._client, REGISTER, registration)
            except Unauthorized:
                raise Unauthorized(f"the coordinator at {self.endpoint} refused this role's token: "
                                   f"${TOKEN_ENV} must be its job's") from None
            except Unavailable as exc:
                if exc.fields.get("waiting"):  # held for an elastic job's next term, not unreachable
                    log.info("coordinator at %s: %s", self.endpoint, exc.message)
                    budget = RetryBudget(retries=3, window_s=self.reconnect_s, first_delay_s=0.2)
                    continue
                if not budget.allows_retry():
                    raise Unavailable(f"the coordinator at {self.endpoint} is unreachable or not ready "
                                      f"after {budget.waited_s:.0f} s: {exc.message}") from None
                log.info("coordinator at %s: %s; asking again", self.endpoint, exc.message)
                await budget.wait()

    async def watch(self, reconnect_s: float, every_s: float = 2.0, *, presence: Presence | None = None) -> None:
        """Return (as Unavailable) only once the coordinator has been unreachable for
        `reconnect_s`: a role whose job is gone must not serve for ever. With `presence` (a
        role of an elastic job) it says so every `every_s`, and raises Regrouped once the
        coordinator says that the role's term is over."""
        lost: float | None = None
        while True:
            await asyncio.sleep(every_s)
            try:
                if presence is not None:
                    await self.present(presence, timeout=max(every_s * 2, 1.0))
                else:  # whether it answers, not what: the health of another version would do
                    await self._client.call(HEALTH.method, HEALTH.target(), timeout=every_s * 2)
                lost = None
            except (Unavailable, TimedOut):  # a coordinator too busy to answer in time is lost too
                lost = lost or time.monotonic()
                if time.monotonic() - lost >= reconnect_s:
                    raise Unavailable(f"the coordinator at {self.endpoint} has been unreachable for "
                                      f"{reconnect_s:g} s (cluster.reconnect_s)") from None

    async def present(self, presence: Presence, *, timeout: float | None = None) -> None:
        """Tell the coordinator this role is alive (or cannot go on: `presence.failure`);
        Regrouped if its term is over."""
        answer: PresenceAnswer = await ask(self._client, PRESENCE, presence, timeout=timeout)
        if answer.regroup:
            now = "is regrouping" if answer.term == presence.term else f"is at term {answer.term}"
            raise Regrouped(f"the job {now}: {presence.role} {presence.index}'s term {presence.term} is over",
                            term=answer.term)

    async def complete_checkpoint(self, done: DenseCheckpoint) -> tuple[int, ...]:
        """Have the coordinator make checkpoint `done.checkpoint` complete; the complete
        checkpoints it keeps."""
        answer: CheckpointCompleted = await ask(self._client, COMPLETE_CHECKPOINT, done)
        return answer.kept

    async def resumed_from(self) -> int | None:
        """The checkpoint the coordinator's run resumed from, or None."""
        answer: ResumePoint = await ask(self._client, RESUME_POINT)
        return answer.resumed_from

    async def stop_stream(self) -> None:
        """End the job's stream (`data.watch`) at its next checkpoint (``POST /v1/stop``);
        Conflict for a run over a data set."""
        await ask(self._client, STOP)

    async def ingest(self, rows: bytes) -> IngestReceipt:
        """Push rows to the job's stream (``POST /v1/ingest``), in its format; answered once
        they are on disk. BadRequest naming the first bad line."""
        return await ask(self._client, INGEST, IngestBody(data=rows))

    async def dense_state(self, checkpoint: int) -> bytes:
        """Complete checkpoint `checkpoint`'s dense state, as `torch.save` wrote it."""
        return await ask(self._client, DENSE, DenseRequest(checkpoint=checkpoint))

    async def close(self) -> None:
        await self._client.close()
