"""Client of all PS shards: splits keys by shard and talks to every shard concurrently.

One long-lived connection per shard (HTTP/2 multiplexes every request on it). Calls that
fail because a shard is unreachable are retried with exponential backoff, then raise
`Unavailable` naming the shard; errors the shard answered (4xx) are raised at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson

from common.auth import bearer
from common.errors import Conflict, TimedOut, Unavailable
from common.keys import split_by_shard
from common.spec import Endpoint, Transport
from common.transport import connect_client
from common.wire import decode, encode_parts, require

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Rows:
    """Rows fetched from the PS, in the order of the keys asked for."""

    rows: np.ndarray  # float32 [n, dim]
    state: np.ndarray  # float32 [n, state_width]
    versions: np.ndarray  # int64 [n]


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
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.dim = dim
        self.state_width = state_width
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._clients = [
            connect_client(transport, e.host, e.port, token=token, timeout=timeout_s) for e in endpoints
        ]

    @property
    def num_shards(self) -> int:
        return len(self.endpoints)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients))

    async def fetch(self, keys: np.ndarray, min_versions: np.ndarray | None = None, *, wait_s: float | None = None) -> Rows:
        """Rows of `keys` once each has reached its min_version (default: any version)."""
        keys = np.asarray(keys, dtype=np.int64)
        if min_versions is None:
            min_versions = np.full(len(keys), -1, dtype=np.int64)
        out = Rows(
            rows=np.empty((len(keys), self.dim), np.float32),
            state=np.empty((len(keys), self.state_width), np.float32),
            versions=np.empty(len(keys), np.int64),
        )
        meta: dict[str, Any] = {"timeout_s": wait_s} if wait_s else {}
        # A fetch may wait at the PS for a write-back: give the HTTP call that much longer.
        timeout = self.timeout_s + (wait_s or 0.0)

        async def one(shard: int, pos: np.ndarray) -> None:
            body = encode_parts(meta, {"keys": keys[pos], "min_versions": min_versions[pos]})
            answer = await self._call(shard, "/v1/fetch", body, timeout)
            _, arrays = decode(answer)
            out.rows[pos] = require(arrays, "rows", "<f4", 2)
            out.state[pos] = require(arrays, "state", "<f4", 2)
            out.versions[pos] = require(arrays, "versions", "<i8", 1)

        await self._each_shard(keys, one)
        return out

    async def write_back(
        self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray, version: int, *, flush: bool = False
    ) -> None:
        """Store rows with `version` on their shards; each shard applies its part atomically.
        A `flush` is checkpoint `version`'s copy of rows that stay cached."""
        keys = np.asarray(keys, dtype=np.int64)
        meta = {"version": version, "flush": flush}

        async def one(shard: int, pos: np.ndarray) -> None:
            body = encode_parts(meta, {"keys": keys[pos], "rows": rows[pos], "state": state[pos]})
            await self._call(shard, "/v1/write_back", body, self.timeout_s, replay_version=version)

        await self._each_shard(keys, one)

    async def checkpoint(self, checkpoint_id: int) -> list[dict[str, Any]]:
        """Every shard snapshots its rows now, as checkpoint `checkpoint_id`."""
        return await self._all_shards("/v1/checkpoint", {"id": checkpoint_id})

    async def report_checkpoint(self, checkpoint_id: int, trainer: int, trainers: int) -> list[dict[str, Any]]:
        """Tell every shard that `trainer`'s writes up to `checkpoint_id` are acknowledged;
        returns once each shard has written the checkpoint (all trainers reported)."""
        payload = {"id": checkpoint_id, "trainer": trainer, "trainers": trainers}
        return await self._all_shards("/v1/checkpoint", payload)

    async def restore(self, checkpoint_id: int) -> list[dict[str, Any]]:
        return await self._all_shards("/v1/restore", {"id": checkpoint_id})

    async def health(self) -> list[dict[str, Any]]:
        return [
            orjson.loads(await self._call(s, "/v1/health", b"", self.timeout_s, method="GET"))
            for s in range(self.num_shards)
        ]

    async def _all_shards(self, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        body = orjson.dumps(payload)
        answers = await asyncio.gather(
            *(self._call(s, path, body, self.timeout_s) for s in range(self.num_shards))
        )
        return [orjson.loads(a) for a in answers]

    async def _each_shard(self, keys: np.ndarray, one: Callable[[int, np.ndarray], Awaitable[None]]) -> None:
        parts = split_by_shard(keys, self.num_shards)
        await asyncio.gather(*(one(s, pos) for s, pos in enumerate(parts) if len(pos)))

    async def _call(
        self,
        shard: int,
        path: str,
        body: Any,
        timeout: float,
        *,
        method: str = "POST",
        replay_version: int | None = None,
    ) -> bytes:
        """One request to one shard, retried while the shard is unreachable.

        With `replay_version`, a retried write-back that the shard refuses because it already
        holds exactly that version had landed before the connection broke: that is success.
        """
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await self._clients[shard].call(method, path, body=body, timeout=timeout)
            except Conflict as exc:
                if attempt > 0 and replay_version is not None and exc.fields.get("stored") == replay_version:
                    return b""
                raise
            except TimedOut as exc:
                raise TimedOut(f"PS shard {shard} at {self.endpoints[shard]}: {exc.message}", shard=shard) from exc
            except Unavailable as exc:
                if attempt == self.retries:
                    raise Unavailable(
                        f"PS shard {shard} at {self.endpoints[shard]}: {exc.message} "
                        f"(after {self.retries + 1} attempts)",
                        shard=shard,
                    ) from exc
                log.warning("PS shard %d %s failed (%s); retrying in %.2f s", shard, path, exc.message, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")
