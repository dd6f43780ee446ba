"""Shared state for several proxy replicas: worker membership and load reports kept in Redis.

Owns mirroring (publish local changes, apply other replicas' changes, reload at start-up), riding
out a Redis outage (keep the last known view, reconnect with backoff, push the local view back), and
reading Redis as untrusted input: what another writer put there is validated as a registration or a
report is, a worker URL must pass proxy.worker_networks, and whatever fails is dropped and counted,
never fatal. The in-process registry stays what routing reads; in-flight counts stay per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy import identifiers as ids
from proxy.config import ProxyConfig, StateConfig
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.security.networks import (
    WorkerUrlRefused,
    canonical_url,
    check_worker_url,
    is_worker_url,
    parse_networks,
)
from proxy.security.redact import redact_text
from proxy.security.redisconn import redis_client
from proxy.security.statecrypt import SecretBox
from proxy.workers.registry import Registry, Worker

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
URL_VERDICT_TTL_S = 60.0                 # how long a worker URL's worker_networks verdict is reused
MAX_URL_VERDICTS = 4096
_KINDS = frozenset({"report", "register", "drain", "remove"})
_SOURCES = frozenset({"api", "nodes", "static"})
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class Dropped(ValueError):
    """Something read from Redis that is not applied; `reason` labels the drop counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class RedisState:
    """Keeps one registry in step with Redis; `start()` after the event loop runs, `stop()` at the end."""

    def __init__(self, registry: Registry, state: StateConfig | str, proxy: ProxyConfig | None = None, *,
                 on_dropped: Callable[[str], None] | None = None) -> None:
        self.registry = registry
        self.state = StateConfig(url=state) if isinstance(state, str) else state
        self.url = self.state.url
        proxy = proxy or ProxyConfig()
        self._networks = parse_networks(proxy.worker_networks)
        self._own = ({proxy.port}, {proxy.host})  # a worker URL there would loop requests into this proxy
        self._box = SecretBox.from_config(self.state.secret_key, proxy.admin_token)
        self._verdicts: dict[str, tuple[float, str | None]] = {}  # url -> (until, refusal or None)
        self._refused: dict[str, float] = {}  # worker id whose entry was dropped -> until when it stays so
        self.dropped: Counter[str] = Counter()  # reason -> entries and events dropped (also a metric)
        self._on_dropped = on_dropped
        self.replica_id = uuid.uuid4().hex[:12]
        self._redis: aioredis.Redis | None = None
        self._outbox: asyncio.Queue[tuple[str, str, bytes]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._applying = False
        self.connected = False
        self.subscribed = False  # the events channel is being listened to now
        self._warned_unsealed: WorkerRegistration | None = None  # say it once per registration, not per event

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._redis = redis_client(self.state, connect_timeout_s=2, timeout_s=5)
        self._outbox = asyncio.Queue(MAX_BACKLOG)
        try:
            await self._load()
            self.connected = True
        except (RedisError, OSError, TimeoutError) as exc:
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
            event["entry"] = self._entry(worker)
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
            except (RedisError, OSError, TimeoutError) as exc:
                self._set_connected(False, exc)
                await asyncio.sleep(1.0)  # these events are lost; the resync pushes the whole view again
            except Exception:  # never let the writer die: the resync repairs what these events would have
                log.exception("writing to redis failed; continuing")
                await asyncio.sleep(1.0)

    # --- redis -> local -------------------------------------------------------------------------
    async def _subscribe_loop(self) -> None:
        """Apply other replicas' events; resubscribe, with backoff, after any error whatsoever."""
        assert self._redis is not None
        backoff = 0.5
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(EVENTS_CHANNEL)
                    self.subscribed, backoff = True, 0.5
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            await self._take_event(message.get("data"))
            except (RedisError, OSError, TimeoutError) as exc:
                self._set_connected(False, exc)
            except Exception:
                log.exception("redis subscriber failed; subscribing again in %.1fs", backoff)
            self.subscribed = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _take_event(self, data: object) -> None:
        """One pub/sub message: applied when well-formed and allowed, else dropped and counted."""
        try:
            event = orjson.loads(data) if isinstance(data, bytes | str) else None
            if not isinstance(event, dict) or event.get("kind") not in _KINDS:
                raise Dropped("malformed", "not an event")
            if event.get("origin") == self.replica_id:
                return
            worker_id = _worker_id(event.get("worker_id"))
            kind = event["kind"]
            if kind == "report":
                report = _report(worker_id, event.get("report"))
                if self.registry.get(worker_id) is not None:
                    self._quietly(lambda: self.registry.record_report(worker_id, report))
            elif kind in ("register", "drain"):
                await self._adopt(worker_id, event.get("entry"))
            else:
                self._quietly(lambda: self.registry.remove(worker_id))
        except (Dropped, ValueError, TypeError, KeyError) as exc:
            self._drop(exc)

    def _quietly(self, change: Callable[[], object]) -> None:
        """Make a change that came from Redis without publishing it back."""
        self._applying = True
        try:
            change()
        finally:
            self._applying = False

    async def _adopt(self, worker_id: str, entry: object) -> None:
        """A worker entry as registration would take it: the same schema, identifier grammar and
        worker_networks check; its engine key unsealed when this replica shares the key."""
        if not isinstance(entry, dict):
            raise Dropped("malformed", f"entry of {worker_id} is not an object")
        reg = WorkerRegistration.model_validate(entry.get("registration"))
        source, secret = entry.get("source", "api"), entry.get("secret_hash")
        if reg.worker_id != worker_id or source not in _SOURCES or not is_worker_url(reg.url):
            raise Dropped("invalid", f"entry of {worker_id} names another id, source or no usable url")
        if secret is not None and not (isinstance(secret, str) and _SHA256_HEX.fullmatch(secret)):
            raise Dropped("invalid", f"entry of {worker_id} has a malformed secret hash")
        reg = reg.model_copy(update={"url": canonical_url(reg.url)})
        await self._check_url(worker_id, reg.url)
        sealed = entry.get("api_key_sealed")
        if sealed is not None:
            key = self._box.open(sealed, worker_id)
            if key is None:
                self._count("key_unreadable")
                log.warning("cannot open the engine key of %s from redis (state.secret_key, or the admin token it "
                            "defaults to, differs between replicas?); sending it none", worker_id)
            reg = reg.model_copy(update={"api_key": key})
        existing = self.registry.get(worker_id)
        if existing is None or existing.registration != reg or existing.secret_hash != secret:
            self._quietly(lambda: self.registry.register(reg, source=source, secret_hash=secret))
        if entry.get("draining") is True:
            self._quietly(lambda: self.registry.drain(worker_id))

    async def _check_url(self, worker_id: str, url: str) -> None:
        """Dropped("url_not_allowed") unless `url` passes proxy.worker_networks, as at registration."""
        now = time.monotonic()
        cached = self._verdicts.get(url)
        if cached is None or cached[0] < now:
            if len(self._verdicts) >= MAX_URL_VERDICTS:
                self._verdicts.clear()
            try:
                await check_worker_url(url, self._networks, *self._own)
                refusal = None
            except WorkerUrlRefused as exc:
                refusal = str(exc)
                log.warning("refused worker %s from redis: %s", ids.for_log(worker_id), refusal)
            cached = self._verdicts[url] = (now + URL_VERDICT_TTL_S, refusal)
        if cached[1] is not None:
            raise Dropped("url_not_allowed", cached[1])

    def _drop(self, exc: Exception) -> None:
        reason = exc.reason if isinstance(exc, Dropped) else "invalid"
        self._count(reason)
        log.debug("dropped from redis (%s): %s", reason, ids.for_log(str(exc), 300))

    def _count(self, reason: str) -> None:
        self.dropped[reason] += 1
        if self._on_dropped is not None:
            self._on_dropped(reason)

    async def _load(self) -> None:
        """Take the fleet Redis knows (a restarted proxy has its workers back at once); what is malformed
        or not allowed there is dropped, one entry at a time."""
        assert self._redis is not None
        entries = await self._redis.hgetall(WORKERS_KEY)
        reports = {}
        if entries:
            keys = [REPORT_KEY.format(k.decode(errors="replace")) for k in entries]
            reports = dict(zip(entries, await self._redis.mget(keys), strict=True))
        before = len(self.registry)
        for raw_id, raw_entry in entries.items():
            try:
                worker_id = _worker_id(raw_id.decode(errors="replace"))
                await self._adopt(worker_id, orjson.loads(raw_entry))
                if reports.get(raw_id) and self.registry.get(worker_id) is not None:
                    report = _report(worker_id, orjson.loads(reports[raw_id]))
                    self._quietly(lambda wid=worker_id, r=report: self.registry.record_report(wid, r))
            except (Dropped, ValueError, TypeError, KeyError) as exc:
                self._drop(exc)
                if len(self._refused) >= MAX_URL_VERDICTS:
                    self._refused.clear()
                self._refused[raw_id.decode(errors="replace")] = time.monotonic() + URL_VERDICT_TTL_S
        if len(self.registry) > before:
            log.info("loaded %d workers from %s", len(self.registry) - before, redact_text(self.url))

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_INTERVAL_S)
            try:
                await self.resync()
                self._set_connected(True)
            except (RedisError, OSError, TimeoutError) as exc:
                self._set_connected(False, exc)
            except Exception:
                log.exception("redis resync failed; trying again")

    async def resync(self) -> None:
        """Repair what pub/sub missed: take workers others added, drop those others removed (their
        tombstone says so), give Redis the ones it lacks."""
        assert self._redis is not None
        known = {k.decode(errors="replace") for k in await self._redis.hkeys(WORKERS_KEY)}
        missing_here = known - {w.worker_id for w in self.registry.workers()} - self._refused_ids(known)
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
                    pipe.hset(WORKERS_KEY, worker.worker_id, orjson.dumps(self._entry(worker)))
            if len(pipe):
                await pipe.execute()

    def _set_connected(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and not self.connected:
            log.info("redis %s reachable again", redact_text(self.url))
        elif not ok and self.connected:
            log.warning("redis %s unreachable (%s); routing on the last known view", redact_text(self.url), exc)
        self.connected = ok


    def _refused_ids(self, known: set[str]) -> set[str]:
        """Ids Redis holds whose entries this replica dropped lately: not reloaded at every resync."""
        now = time.monotonic()
        return {k for k in known if self._refused.get(k, 0.0) > now}

    def _entry(self, worker: Worker) -> dict[str, Any]:
        """What Redis keeps of a worker: never a secret in plain text (the worker's secret only as its
        SHA-256; its engine key sealed, or not kept at all without a key to seal it with)."""
        assert worker.registration is not None
        entry = {"registration": worker.registration.model_dump(mode="json", exclude={"api_key"}),
                 "source": worker.source, "draining": worker.drain_requested, "secret_hash": worker.secret_hash}
        if worker.registration.api_key:
            sealed = self._box.seal(worker.registration.api_key, worker.worker_id)
            if sealed is not None:
                entry["api_key_sealed"] = sealed
            elif worker.registration is not self._warned_unsealed:
                self._warned_unsealed = worker.registration
                log.warning("%s has an engine key, and no state.secret_key or admin token seals it: other "
                            "replicas will not have it", worker.worker_id)
        return entry


def _worker_id(value: object) -> str:
    try:
        return ids.worker_id(value)  # type: ignore[arg-type]
    except ids.UnsafeIdentifier as exc:
        raise Dropped("invalid", f"worker id: {exc}") from None


def _report(worker_id: str, data: object) -> LoadReport:
    report = LoadReport.model_validate(data)
    if report.worker_id != worker_id:
        raise Dropped("invalid", f"a report of {report.worker_id} filed under {worker_id}")
    return report
