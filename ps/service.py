"""The parameter-server shard as an HTTP service: routes → `ShardStore`.

Routes (all bodies binary per `common.wire` unless noted):

* ``POST /v1/fetch``  keys int64 [n], min_versions int64 [n] (optional, default −1);
  meta ``timeout_s`` (optional). Waits, without polling, until every key has reached its
  min_version, then answers rows float32 [n, d], state float32 [n, s], versions int64 [n].
  A wait past the timeout answers 504; stale data is never served.
* ``POST /v1/write_back``  meta ``version`` (and ``flush: true`` for a checkpoint flush);
  keys int64 [n], rows, state. Atomic: the whole request is validated first (409 if any key
  already has this version or a newer one; a flush may be older than the stored row). With
  ``replay: true`` it may repeat or precede what the shard holds (`ShardStore`).
* ``POST /v1/checkpoint``  JSON ``{"id": c}``: snapshot now, as of iteration c. With
  ``"trainer": j, "trainers": T``: trainer j reports that all its writes of versions <= c
  were acknowledged; the snapshot of c is taken once all T reported, and every report is
  answered when it is on disk (507 if it could not be written); a report of a checkpoint
  already on disk is answered at once.
* ``POST /v1/restore``  JSON ``{"id": c}``.
* ``GET /v1/health`` and ``GET /metrics`` (public, for curl and Prometheus).

Every process has a random *incarnation*, shown by health. A request whose
``bagpipe-incarnation`` header names another one was meant for an earlier process of this
shard: it is answered 409 ``restarted`` so that its client replays its write-backs first.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from common.errors import BadRequest, Conflict, Restarted, StorageFailed, TimedOut
from common.metrics import Registry
from common.transport import Request, Response, Router
from common.wire import decode, encode_parts, require
from ps.checkpoint import list_checkpoints, load_snapshot, save_snapshot, saved_checkpoint
from ps.store import ShardStore

log = logging.getLogger(__name__)
INCARNATION_HEADER = "bagpipe-incarnation"


@dataclass(eq=False)
class _Waiter:
    local: np.ndarray
    min_versions: np.ndarray
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class PsService:
    """Owns one shard store and answers its routes; one instance per shard process."""

    def __init__(
        self,
        store: ShardStore,
        *,
        checkpoint_dir: Path,
        fetch_timeout_s: float,
        registry: Registry | None = None,
    ) -> None:
        self.store = store
        self.checkpoint_dir = checkpoint_dir
        self.fetch_timeout_s = fetch_timeout_s
        self.metrics = registry or Registry()
        self._waiters: set[_Waiter] = set()
        self._reports: dict[int, tuple[set[int], asyncio.Future[dict[str, Any]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.incarnation = secrets.token_hex(8)

    def router(self) -> Router:
        router = Router()
        router.add("POST", "/v1/fetch", self.fetch)
        router.add("POST", "/v1/write_back", self.write_back)
        router.add("POST", "/v1/checkpoint", self.checkpoint)
        router.add("POST", "/v1/restore", self.restore)
        router.add("GET", "/v1/health", self.health, public=True)
        router.add("GET", "/metrics", self.render_metrics, public=True)
        return router

    async def fetch(self, request: Request) -> Response:
        self._check_incarnation(request)
        meta, arrays = decode(request.body)
        keys = require(arrays, "keys", "<i8", 1)
        if "min_versions" in arrays:
            min_versions = require(arrays, "min_versions", "<i8", 1)
            if min_versions.shape != keys.shape:
                raise BadRequest("min_versions must have one entry per key")
        else:
            min_versions = np.full(keys.shape, -1, dtype=np.int64)
        timeout = _positive(meta.get("timeout_s", self.fetch_timeout_s), "timeout_s")
        local = self.store.check_keys(keys)
        await self._wait_for_versions(local, min_versions, timeout)
        rows, state, versions = self.store.gather(local)
        self._count("fetch", len(keys), request, rows.nbytes + state.nbytes)
        body = encode_parts({}, {"rows": rows, "state": state, "versions": versions})
        return Response(body=body)

    async def write_back(self, request: Request) -> Response:
        self._check_incarnation(request)
        meta, arrays = decode(request.body)
        version = meta.get("version")
        if type(version) is not int:
            raise BadRequest("meta.version must be an integer")
        flush, replay = _flag(meta, "flush"), _flag(meta, "replay")
        keys = require(arrays, "keys", "<i8", 1)
        rows = require(arrays, "rows", "<f4", 2)
        state = require(arrays, "state", "<f4", 2)
        local = self.store.check_write(keys, rows, state, version, flush=flush, replay=replay)
        self.store.write_back(local, rows, state, version, flush=flush, replay=replay)
        self._count("replay" if replay else "write_back", len(keys), request, 0)
        self._wake_waiters()
        return Response.json({"written": len(keys), "version": version})

    async def checkpoint(self, request: Request) -> Response:
        self._check_incarnation(request)
        payload = _json_object(request.body)
        checkpoint_id = _non_negative(payload, "id")
        if "trainer" not in payload:
            return Response.json(await self._take_checkpoint(checkpoint_id))
        trainers = _non_negative(payload, "trainers")
        trainer = _non_negative(payload, "trainer")
        if not trainer < trainers:
            raise BadRequest(f"trainer {trainer} is not below trainers = {trainers}")
        if checkpoint_id <= self.store.last_checkpoint and checkpoint_id not in self._reports:
            # A report retried across a restart of this shard: its snapshot may be on disk.
            saved = saved_checkpoint(self.checkpoint_dir, checkpoint_id)
            if saved is None:
                raise Conflict(f"checkpoint {checkpoint_id} was already taken", id=checkpoint_id)
            path, nbytes = saved
            return Response.json({"id": checkpoint_id, "path": str(path), "bytes": nbytes, "seconds": 0.0})
        reported, done = self._reports.setdefault(checkpoint_id, (set(), asyncio.get_running_loop().create_future()))
        reported.add(trainer)
        if len(reported) == trainers and not done.done():
            self._finish_checkpoint(checkpoint_id, done)
        return Response.json(await asyncio.shield(done))

    def _finish_checkpoint(self, checkpoint_id: int, done: asyncio.Future[dict[str, Any]]) -> None:
        async def take() -> None:
            try:
                done.set_result(await self._take_checkpoint(checkpoint_id))
            except BaseException as exc:  # every waiting reporter gets the error
                done.set_exception(exc)
            finally:
                self._reports.pop(checkpoint_id, None)

        task = asyncio.ensure_future(take())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _take_checkpoint(self, checkpoint_id: int) -> dict[str, Any]:
        """Snapshot as of `checkpoint_id` and write it out (in a thread: the loop keeps serving)."""
        started = time.perf_counter()
        snap = self.store.snapshot(checkpoint_id)
        meta = {"shard": self.store.config.shard, "num_shards": self.store.config.num_shards}
        try:
            path, nbytes = await asyncio.to_thread(save_snapshot, self.checkpoint_dir, checkpoint_id, snap, meta)
        except OSError as exc:
            log.error("checkpoint %d could not be written to %s: %s", checkpoint_id, self.checkpoint_dir, exc)
            self.metrics.inc("checkpoint_failures_total", help="Checkpoints that could not be written")
            raise StorageFailed(f"checkpoint {checkpoint_id} could not be written to {self.checkpoint_dir}: {exc}") from None
        seconds = time.perf_counter() - started
        self.metrics.observe("checkpoint_seconds", seconds, help="Time to write a checkpoint")
        self.metrics.inc("checkpoint_bytes_total", nbytes, help="Bytes written by checkpoints")
        log.info("checkpoint %d: %d bytes in %.3f s at %s", checkpoint_id, nbytes, seconds, path)
        return {"id": checkpoint_id, "path": str(path), "bytes": nbytes, "seconds": seconds}

    async def restore(self, request: Request) -> Response:
        checkpoint_id = _non_negative(_json_object(request.body), "id")
        snap, _ = await asyncio.to_thread(load_snapshot, self.checkpoint_dir, checkpoint_id)
        self.store.restore(snap, checkpoint_id)
        self._wake_waiters()
        return Response.json({"id": checkpoint_id, "rows": int(len(snap.local))})

    async def health(self, request: Request) -> Response:
        cfg = self.store.config
        return Response.json(
            {
                "role": "ps",
                "shard": cfg.shard,
                "num_shards": cfg.num_shards,
                "rows": self.store.num_rows,
                "dim": cfg.dim,
                "incarnation": self.incarnation,
                "max_version": self.store.max_version(),
                "checkpoints": list_checkpoints(self.checkpoint_dir),
            }
        )

    async def render_metrics(self, request: Request) -> Response:
        self.metrics.set("fetches_waiting", len(self._waiters), help="Fetches waiting for a version")
        body = self.metrics.render().encode()
        return Response(body=body, content_type="text/plain; version=0.0.4")

    async def _wait_for_versions(self, local: np.ndarray, min_versions: np.ndarray, timeout: float) -> None:
        if self.store.ready(local, min_versions):
            return
        waiter = _Waiter(local, min_versions)
        self._waiters.add(waiter)
        started = time.perf_counter()
        try:
            await asyncio.wait_for(waiter.ready.wait(), timeout)
        except TimeoutError:
            behind = int((self.store.gather(local)[2] < min_versions).sum())
            raise TimedOut(
                f"{behind} of {len(local)} rows did not reach their version within {timeout:g} s",
                rows_behind=behind,
            ) from None
        finally:
            self._waiters.discard(waiter)
            self.metrics.observe("fetch_wait_seconds", time.perf_counter() - started,
                                 help="Time fetches waited for a write-back")

    def _check_incarnation(self, request: Request) -> None:
        meant = request.headers.get(INCARNATION_HEADER)
        if meant is not None and meant != self.incarnation:
            raise Restarted(
                f"PS shard {self.store.config.shard} restarted: incarnation {self.incarnation}, not {meant}",
                incarnation=self.incarnation,
            )

    def _wake_waiters(self) -> None:
        for waiter in self._waiters:
            if not waiter.ready.is_set() and self.store.ready(waiter.local, waiter.min_versions):
                waiter.ready.set()

    def _count(self, op: str, rows: int, request: Request, bytes_out: int) -> None:
        labels = {"op": op}
        self.metrics.inc("requests_total", labels=labels, help="Requests served")
        self.metrics.inc("rows_total", rows, labels=labels, help="Rows fetched or written")
        self.metrics.inc("bytes_in_total", len(request.body), labels=labels, help="Request body bytes")
        self.metrics.inc("bytes_out_total", bytes_out, labels=labels, help="Row bytes sent")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body must be a JSON object: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest("body must be a JSON object")
    return payload


def _flag(meta: dict[str, Any], name: str) -> bool:
    value = meta.get(name, False)
    if type(value) is not bool:
        raise BadRequest(f"meta.{name} must be a boolean")
    return value


def _non_negative(payload: dict[str, Any], name: str) -> int:
    value = payload.get(name)
    if type(value) is not int or value < 0:
        raise BadRequest(f"{name!r} must be a non-negative integer, got {value!r}")
    return value


def _positive(value: Any, name: str) -> float:
    if type(value) not in (int, float) or not value > 0:
        raise BadRequest(f"meta.{name} must be a positive number, got {value!r}")
    return float(value)
