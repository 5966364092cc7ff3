from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from common.keys import TableLayout
from common.spec import Endpoint
from common.transport import H2Server, Http1Server, Tls
from ps.client import PsClient
from ps.service import PsService
from ps.store import ShardConfig, ShardStore

#: Everything a store holds, copied (`raw_state`).
RawState = list[np.ndarray | int]

TOKEN = "test-token"
LAYOUT = TableLayout((100, 50))
DIM = 4
MAX_BODY = 1 << 20


@dataclass
class Cluster:
    services: list[PsService]
    servers: list[H2Server | Http1Server]
    client: PsClient
    transport: str

    @property
    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(host="127.0.0.1", port=s.port) for s in self.servers]


def make_service(
    shard: int, num_shards: int, checkpoint_dir: Path, fetch_timeout_s: float = 5.0, rejoin_trainers: int = 0,
    num_trainers: int | None = None,
) -> PsService:
    """`rejoin_trainers`: restarted alone, it holds fetches until that many trainers reported;
    `num_trainers`: the job's trainer count (None: not told)."""
    cfg = ShardConfig(
        shard=shard, num_shards=num_shards, layout=LAYOUT, dim=DIM, state_width=1, state_init=0.1,
        state_min=0.0, seed=3,
    )
    return PsService(ShardStore(cfg), checkpoint_dir=checkpoint_dir / f"ps-{shard}", fetch_timeout_s=fetch_timeout_s,
                     rejoin_trainers=rejoin_trainers, num_trainers=num_trainers)


def make_server(kind: str, service: PsService, port: int = 0, tls: Tls | None = None) -> H2Server | Http1Server:
    cls = H2Server if kind == "h2" else Http1Server
    return cls(service.router(), host="127.0.0.1", port=port, token=TOKEN, max_body_bytes=MAX_BODY, tls=tls)


@pytest.fixture(params=["h2", "http1"])
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Cluster]:
    kind = request.param
    services = [make_service(s, 2, tmp_path) for s in range(2)]
    servers = [make_server(kind, svc) for svc in services]
    for server in servers:
        await server.start()
    endpoints = [Endpoint(host="127.0.0.1", port=s.port) for s in servers]
    client = PsClient(endpoints, token=TOKEN, dim=DIM, state_width=1, transport=kind, timeout_s=10, retries=1, backoff_s=0.05)
    yield Cluster(services, servers, client, kind)
    await client.close()
    for server in servers:
        await server.stop()


def raw_state(store: ShardStore) -> RawState:
    """Everything a store holds, copied: its arrays, its saved checkpoint rows, its counters."""
    saved = [a for s in store._saved for a in (*vars(s.rows).values(), s.until)]
    arrays = (store._rows, store._state, store._versions, store._touched, *saved)
    return [a.copy() for a in arrays] + [store.last_checkpoint, store.max_version, len(store._saved)]


def same_state(a: RawState, b: RawState) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


async def until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    """Wait for a condition that another task makes true (bounded; yields to the loop)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)
