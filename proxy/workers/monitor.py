"""Background health probes and /metrics scrapes, and adding workers by URL alone.

Owns the I/O that keeps the registry's view honest for workers that do not report (static
config workers, LMDeploy /nodes/add) and for reporting workers whose reports stopped (their
proxy died, say): scrape /metrics a few times a second, else probe /health. State transitions
themselves are the registry's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from proxy.protocol import MAX_STEP_TOKENS, WorkerRegistration
from proxy.security.networks import canonical_url
from proxy.workers.engine_metrics import parse_engine_metrics
from proxy.workers.probe_session import Upstream
from proxy.workers.registry import Registry, Worker, WorkerState

log = logging.getLogger("kvroute.monitor")

CHECK_INTERVAL_S = 0.25
SCRAPE_INTERVAL_S = 0.5      # non-reporting workers: /metrics at 2 Hz
PROBE_INTERVAL_S = 1.0       # stale or unhealthy workers: /health once a second
PROBE_TIMEOUT_S = 2.0
# Listing a URL-only worker's models (/nodes/add, static workers) takes at most this long; a failed
# /nodes/add answers only then, so its timing does not tell an open port from a closed one.
PROBE_MODELS_DEADLINE_S = 2 * PROBE_TIMEOUT_S
# A self-registered (reporting) worker silent this long, and failing its /health probe, is forgotten (one
# that answers stays: its proxy may have died, DESIGN's replicas); if it comes back, its
# reporter gets 404 on its next report and registers again. Static and /nodes workers stay.
FORGET_SILENT_AFTER_S = 300.0


async def probe_models(session: aiohttp.ClientSession, url: str) -> tuple[list[str], int | None]:
    """The model ids (and max_model_len, if given) a worker's /v1/models lists; raises on failure."""
    timeout = aiohttp.ClientTimeout(total=PROBE_MODELS_DEADLINE_S)
    # Never follow a redirect: a worker URL must not become a way to make the proxy fetch another address.
    async with session.get(url.rstrip("/") + "/v1/models", timeout=timeout, allow_redirects=False) as resp:
        resp.raise_for_status()
        if resp.status != 200:  # a redirect (not followed) or another non-answer
            raise ValueError(f"{url}/v1/models answered {resp.status}")
        body = await resp.json(content_type=None)
    data = body.get("data", []) if isinstance(body, dict) else []
    models = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    lengths = [m["max_model_len"] for m in data if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)
               and 0 < m["max_model_len"] <= MAX_STEP_TOKENS]  # an implausible length is no length
    if not models:
        raise ValueError(f"{url}/v1/models lists no models")
    return models, (max(lengths) if lengths else None)


class HealthMonitor:
    """One background task checking every worker that needs it, each at its own cadence."""

    def __init__(self, registry: Registry, upstream: Upstream) -> None:
        self.registry = registry
        self._upstream = upstream  # probes share its pooled session, which exists once started
        self._last_check: dict[str, float] = {}
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._upstream.session

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name="kvroute-monitor")

    async def stop(self) -> None:
        tasks = [t for t in (self._main, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def add_by_url(self, url: str, models: list[str] | None = None, engine: str = "unknown",
                         source: str = "nodes", labels: dict[str, str] | None = None,
                         secret_hash: str | None = None) -> Worker:
        """Register a non-reporting worker; without `models`, ask its /v1/models (raises if it cannot)."""
        max_len = None
        url = canonical_url(url)
        if not models:
            models, max_len = await probe_models(self.session, url)
        reg = WorkerRegistration(url=url, models=models, engine=engine, reports=False, max_model_len=max_len,  # type: ignore[arg-type]
                                 labels=labels or {})
        worker = self.registry.register(reg, source=source, secret_hash=secret_hash)
        self._last_check.pop(worker.worker_id, None)
        return worker

    async def add_static(self, url: str, models: list[str], engine: str) -> None:
        """Config's static workers: keep trying until the worker answers /v1/models (it may start later)."""
        delay = 0.5
        while True:
            try:
                await self.add_by_url(url, models or None, engine, source="static")
                return
            except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
                log.info("static worker %s not available yet (%s); retrying in %.1fs", url, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        while True:
            now = self.registry.clock()
            workers = self.registry.workers()
            if len(self._last_check) > len(workers):  # forget removed workers (ids churn under /nodes/add)
                present = {w.worker_id for w in workers}
                self._last_check = {k: v for k, v in self._last_check.items() if k in present}
            for worker in workers:
                if self._long_silent(worker, now):
                    log.warning("forgetting %s: no report for %.0fs", worker.worker_id, FORGET_SILENT_AFTER_S)
                    self.registry.remove(worker.worker_id)
                    continue
                interval = self._interval(worker, now)
                if interval is None or worker.worker_id in self._busy:
                    continue
                if now - self._last_check.get(worker.worker_id, -1e9) < interval:
                    continue
                self._last_check[worker.worker_id] = now
                self._busy.add(worker.worker_id)
                self.spawn(self._check(worker))
            await asyncio.sleep(CHECK_INTERVAL_S)

    @staticmethod
    def _long_silent(worker: Worker, now: float) -> bool:
        if not worker.reports or worker.load.in_flight or not worker.probe_failed:
            return False  # a worker that still answers its /health probe is alive: only its reports stopped
        last = worker.load.reading_at if worker.load.reading_at is not None else worker.registered_mono
        return now - last > FORGET_SILENT_AFTER_S

    def _interval(self, worker: Worker, now: float) -> float | None:
        if not worker.reports:
            return SCRAPE_INTERVAL_S
        state = worker.state(now)
        if state is WorkerState.STALE or self._scraped_instead(worker):
            return SCRAPE_INTERVAL_S  # its reports stopped: read its engine's /metrics as if it sent none
        if state is WorkerState.UNHEALTHY:
            return PROBE_INTERVAL_S
        return None  # a reporting, fresh worker needs no probing

    @staticmethod
    def _scraped_instead(worker: Worker) -> bool:
        """A reporting worker kept fresh by scrapes: its reports stopped (their proxy died, a partition) while
        its engine still answers. Scraped at the non-reporting cadence, it stays ready and routed normally."""
        return worker.reports and worker.load.reading_source == "metrics"

    async def _check(self, worker: Worker) -> None:
        try:
            if (not worker.reports or self._scraped_instead(worker) or worker.state(self.registry.clock())
                    is WorkerState.STALE) and await self._scrape(worker):
                return
            ok, error = await self._probe_health(worker)
            if worker.reports or not ok:
                self.registry.record_probe(worker, ok, error)
            else:
                self.registry.record_scrape(worker, None)  # answers, but has no /metrics we can read
        finally:
            self._busy.discard(worker.worker_id)

    async def _scrape(self, worker: Worker) -> bool:
        try:
            async with self.session.get(worker.url + "/metrics", allow_redirects=False,
                                        timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return False
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False
        reading = parse_engine_metrics(text)
        if reading is None:
            return False
        self.registry.record_scrape(worker, reading)
        return True

    async def _probe_health(self, worker: Worker) -> tuple[bool, str | None]:
        started = time.monotonic()
        try:
            async with self.session.get(worker.url + "/health", allow_redirects=False,
                                        timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                await resp.read()
                if resp.status == 200:
                    return True, None
                return False, f"/health answered {resp.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.debug("probe of %s failed after %.2fs: %r", worker.worker_id, time.monotonic() - started, exc)
            return False, f"/health probe failed: {type(exc).__name__}"
