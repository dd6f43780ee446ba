"""Shared state for several proxy replicas: worker membership and load reports kept in Redis.

Owns mirroring (publish local changes, apply other replicas' changes, reload at start-up) and
riding out a Redis outage (keep the last known view, reconnect with backoff, push the local
view back). The in-process registry stays what routing reads; in-flight counts stay per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy.protocol import LoadReport, WorkerRegistration
from proxy.registry import Registry, Worker
from proxy.security.redact import redact_text

log = logging.getLogger("kvroute.state")

WORKERS_KEY = "kvroute:workers"          # hash: worker_id -> {"registration", "source", "draining"}
REPORT_KEY = "kvroute:report:{}"         # newest report per worker, expiring like a stale worker
TOMBSTONE_KEY = "kvroute:removed:{}"     # a removed worker, so no replica's resync brings it back
EVENTS_CHANNEL = "kvroute:events"        # pub/sub: every change, tagged with the replica it came from
REPORT_TTL_S = 10
RESYNC_INTERVAL_S = 2.0
# Longer than any replica can miss events and still resync (a replica away from Redis longer than this
# pushes its view back whole); a new registration of the worker lifts it at once.
TOMBSTONE_TTL_S = 300
MAX_BACKLOG = 10_000                     # events kept while Redis is away; older ones are dropped


class RedisState:
    """Keeps one registry in step with Redis; `start()` after the event loop runs, `stop()` at the end."""

    def __init__(self, registry: Registry, url: str) -> None:
        self.registry = registry
        self.url = url
        self.replica_id = uuid.uuid4().hex[:12]
        self._redis: aioredis.Redis | None = None
        self._outbox: asyncio.Queue[tuple[str, str, bytes]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._applying = False
        self.connected = False

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._redis = aioredis.from_url(self.url, socket_connect_timeout=2, socket_timeout=5)
        self._outbox = asyncio.Queue(MAX_BACKLOG)
        try:
            await self._load()
            self.connected = True
        except (RedisError, OSError) as exc:
            log.warning("redis %s unavailable at start-up (%s); starting empty and retrying", redact_text(self.url), exc)
        self.registry.add_listener(self._on_local_change)
        self._tasks = [asyncio.create_task(self._write_loop(), name="kvroute-state-writer"),
                       asyncio.create_task(self._subscribe_loop(), name="kvroute-state-subscriber"),
                       asyncio.create_task(self._resync_loop(), name="kvroute-state-resync")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._redis is not None:
            await self._redis.aclose()

    # --- local -> redis -------------------------------------------------------------------------
    def _on_local_change(self, kind: str, worker: Worker, detail: Any) -> None:
        if self._applying or self._outbox is None:
            return  # a change that came from Redis goes no further
        event: dict[str, Any] = {"origin": self.replica_id, "kind": kind, "worker_id": worker.worker_id}
        if kind == "report":
            event["report"] = detail.model_dump(mode="json")
        elif kind in ("register", "drain"):
            event["entry"] = _entry(worker)
        try:
            self._outbox.put_nowait((kind, worker.worker_id, orjson.dumps(event)))
        except asyncio.QueueFull:
            pass  # Redis has been away for a while; the resync after reconnecting repairs the view

    async def _write_loop(self) -> None:
        assert self._outbox is not None and self._redis is not None
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty() and len(batch) < 256:
                batch.append(self._outbox.get_nowait())
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for kind, worker_id, payload in batch:
                        event = orjson.loads(payload)
                        if kind == "report":
                            pipe.set(REPORT_KEY.format(worker_id), orjson.dumps(event["report"]), ex=REPORT_TTL_S)
                        elif kind in ("register", "drain"):
                            pipe.hset(WORKERS_KEY, worker_id, orjson.dumps(event["entry"]))
                            if kind == "register":  # a registration is newer than any removal
                                pipe.delete(TOMBSTONE_KEY.format(worker_id))
                        elif kind == "remove":
                            pipe.hdel(WORKERS_KEY, worker_id)
                            pipe.delete(REPORT_KEY.format(worker_id))
                            pipe.set(TOMBSTONE_KEY.format(worker_id), b"1", ex=TOMBSTONE_TTL_S)
                        pipe.publish(EVENTS_CHANNEL, payload)
                    await pipe.execute()
                self._set_connected(True)
            except (RedisError, OSError) as exc:
                self._set_connected(False, exc)
                await asyncio.sleep(1.0)  # these events are lost; the resync pushes the whole view again

    # --- redis -> local -------------------------------------------------------------------------
    async def _subscribe_loop(self) -> None:
        assert self._redis is not None
        backoff = 0.5
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(EVENTS_CHANNEL)
                    backoff = 0.5
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._apply(orjson.loads(message["data"]))
            except (RedisError, OSError) as exc:
                self._set_connected(False, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    def _apply(self, event: dict[str, Any]) -> None:
        if event.get("origin") == self.replica_id:
            return
        worker_id = event["worker_id"]
        self._applying = True
        try:
            kind = event["kind"]
            if kind == "report":
                report = LoadReport.model_validate(event["report"])
                if self.registry.get(worker_id) is not None:
                    self.registry.record_report(worker_id, report)
            elif kind in ("register", "drain"):
                self._apply_entry(worker_id, event["entry"])
            elif kind == "remove":
                self.registry.remove(worker_id)
        finally:
            self._applying = False

    def _apply_entry(self, worker_id: str, entry: dict[str, Any]) -> None:
        reg = WorkerRegistration.model_validate(entry["registration"])
        existing = self.registry.get(worker_id)
        secret = entry.get("secret_hash")  # reports for it may reach any replica
        if existing is None or existing.registration != reg or existing.secret_hash != secret:
            self.registry.register(reg, source=entry.get("source", "api"), secret_hash=secret)
        if entry.get("draining"):
            self.registry.drain(worker_id)

    async def _load(self) -> None:
        """Take the fleet Redis knows (a restarted proxy has its workers back at once)."""
        assert self._redis is not None
        entries = await self._redis.hgetall(WORKERS_KEY)
        reports = {}
        if entries:
            keys = [REPORT_KEY.format(k.decode()) for k in entries]
            reports = dict(zip(entries, await self._redis.mget(keys), strict=True))
        self._applying = True
        try:
            for raw_id, raw_entry in entries.items():
                worker_id = raw_id.decode()
                self._apply_entry(worker_id, orjson.loads(raw_entry))
                if reports.get(raw_id):
                    self.registry.record_report(worker_id, LoadReport.model_validate_json(reports[raw_id]))
        finally:
            self._applying = False
        if entries:
            log.info("loaded %d workers from %s", len(entries), redact_text(self.url))

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_INTERVAL_S)
            try:
                await self.resync()
                self._set_connected(True)
            except (RedisError, OSError) as exc:
                self._set_connected(False, exc)

    async def resync(self) -> None:
        """Repair what pub/sub missed: take workers others added, drop those others removed (their
        tombstone says so), give Redis the ones it lacks."""
        assert self._redis is not None
        known = {k.decode() for k in await self._redis.hkeys(WORKERS_KEY)}
        missing_here = known - {w.worker_id for w in self.registry.workers()}
        if missing_here:
            await self._load()
        unknown_there = [w for w in self.registry.workers() if w.worker_id not in known and w.registration]
        if not unknown_there:
            return
        removed = await self._redis.mget([TOMBSTONE_KEY.format(w.worker_id) for w in unknown_there])
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker, tombstone in zip(unknown_there, removed, strict=True):
                if tombstone is not None:
                    log.info("%s was removed by another replica; dropping it here too", worker.worker_id)
                    self._applying = True
                    try:
                        self.registry.remove(worker.worker_id)
                    finally:
                        self._applying = False
                else:
                    pipe.hset(WORKERS_KEY, worker.worker_id, orjson.dumps(_entry(worker)))
            if len(pipe):
                await pipe.execute()

    def _set_connected(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and not self.connected:
            log.info("redis %s reachable again", redact_text(self.url))
        elif not ok and self.connected:
            log.warning("redis %s unreachable (%s); routing on the last known view", redact_text(self.url), exc)
        self.connected = ok


def _entry(worker: Worker) -> dict[str, Any]:
    assert worker.registration is not None
    return {"registration": worker.registration.model_dump(mode="json"), "source": worker.source,
            "draining": worker.drain_requested, "secret_hash": worker.secret_hash}
