"""The worker registry: who serves what, and each worker's state (its circuit breaker: proxy/workers/breaker.py).

Owns workers and their transitions (ready, stale, unhealthy, draining, and recovery); does
no I/O. Handlers and policies ask it questions through methods; proxy/workers/monitor.py probes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from proxy.identifiers import MAX_WORKER_ID_CHARS
from proxy.protocol import STALE_AFTER_S, LoadReport, WorkerRegistration
from proxy.workers.breaker import BreakerState, CircuitBreaker  # noqa: F401  (BreakerState: re-exported)
from proxy.workers.loadview import DEFAULT_CAPACITY_TOKENS, EngineReading, WorkerLoad
from proxy.workers.report_trust import ReportTrust


class WorkerState(StrEnum):
    READY = "ready"
    STALE = "stale"            # reports stopped: routed to only when no ready worker exists
    UNHEALTHY = "unhealthy"    # failed probe, circuit open, or the worker says it failed
    DRAINING = "draining"      # finishes what it has, takes nothing new


class Worker:
    """One engine endpoint behind the proxy."""

    def __init__(self, worker_id: str, url: str, models: Iterable[str], *, engine: str = "unknown",
                 capacity_tokens: int | None = None, max_model_len: int | None = None, reports: bool = True,
                 labels: dict[str, str] | None = None, source: str = "api", now: float = 0.0,
                 role: str = "both") -> None:
        self.worker_id = worker_id
        self.url = url.rstrip("/")
        self.models: tuple[str, ...] = tuple(dict.fromkeys(models))
        self.engine = engine
        self.role = role  # protocol.WorkerRole: both, prefill, decode or encode
        self.max_model_len = max_model_len
        self.reports = reports
        self.labels = dict(labels or {})
        self.source = source
        self.load = WorkerLoad(capacity_tokens)
        self.trust = ReportTrust()  # how far its readings are believed (proxy/workers/report_trust.py)
        self.breaker = CircuitBreaker()
        self.registered_at = time.time()
        self.registered_mono = now
        self.last_report: LoadReport | None = None
        self.registration: WorkerRegistration | None = None  # as registered, for mirroring
        self.reported_state = "ready"
        self.drain_requested = False
        self.probe_failed = False
        self.stalled_at: float | None = None  # sent nothing while holding requests (proxy/dataplane/stall.py)
        self.last_error: str | None = None
        self.secret_hash: str | None = None  # sha256 of the secret its registrant got (proxy/security)
        self.api_key: str | None = None  # sent upstream as Authorization: Bearer, when the engine wants one
        self.kv_resync = False  # its engine's KV-event view needs a snapshot (proxy/routing/engine_blocks.py sets it)
        # predicted vs actual cached tokens of its answers (proxy/routing/cache_feedback.py's CacheAccuracy)
        self.cache_prediction: Any = None

    def replaceable(self, now: float) -> bool:
        """Another registrant may take this worker's id or URL: it has shown no sign of life (report or
        scrape) for TAKEOVER_AFTER_S and is stale or unhealthy. A live worker is never displaced."""
        if self.state(now) not in (WorkerState.STALE, WorkerState.UNHEALTHY):
            return False
        last = self.load.reading_at if self.load.reading_at is not None else self.registered_mono
        return now - last > TAKEOVER_AFTER_S

    def silent(self, now: float) -> bool:
        """It sends no reports now: stale or unhealthy, or a reporting worker that only scrapes of its engine's
        /metrics keep ready (its reporter died or lost its proxy; a restart on its address answers them)."""
        return (self.state(now) in (WorkerState.STALE, WorkerState.UNHEALTHY)
                or (self.reports and self.load.reading_source == "metrics"))

    def serves(self, model: str) -> bool:
        return model in self.models

    def state(self, now: float) -> WorkerState:
        if self.drain_requested or self.reported_state == "draining":
            return WorkerState.DRAINING
        if (self.probe_failed or self.reported_state == "failed" or self.stalled_at is not None
                or self.breaker.is_open(now)):
            return WorkerState.UNHEALTHY
        if self.reports:
            last = self.load.reading_at if self.load.reading_at is not None else self.registered_mono
            if now - last > STALE_AFTER_S or self.reported_state == "starting":
                return WorkerState.STALE
        return WorkerState.READY

    def to_json(self, now: float) -> dict[str, Any]:
        load = self.load
        age = None if load.reading_at is None else round(now - load.reading_at, 3)
        return {
            "worker_id": self.worker_id, "url": self.url, "models": list(self.models), "engine": self.engine,
            "role": self.role, "state": self.state(now).value, "source": self.source, "reports": self.reports,
            "in_flight": load.in_flight, "dispatched_total": load.dispatched_total,
            "kv_capacity_tokens": load.capacity_tokens, "max_model_len": self.max_model_len,
            "projected_kv_usage": round(load.projected_kv_usage(now), 4), "queue_depth": load.queue_depth(now),
            "prefill_backlog_tokens": load.prefill_backlog, "step_tokens": load.step_tokens,
            "reading_source": load.reading_source, "reading_age_s": age,
            "progress_age_s": None if load.progress_at is None else round(now - load.progress_at, 3),
            "last_report": self.last_report.model_dump(mode="json", exclude={"kv_events"}) if self.last_report else None,
            "breaker_open": self.breaker.is_open(now), "stalled": self.stalled_at is not None,
            "report_trust": round(self.trust.factor, 3),
            "last_error": self.last_error,
            "registered_at": self.registered_at, "labels": self.labels,
            "cache_prediction": self.cache_prediction.to_json() if self.cache_prediction is not None else None,
        }


# candidates() keeps its answer for at most this many model names at once.
MAX_CACHED_MODELS = 256
# A registration may take over the id or URL of a worker silent (and stale/unhealthy) this long.
TAKEOVER_AFTER_S = 10.0
_NOT_IN_WORKER_ID = re.compile(r"[^A-Za-z0-9._@~+-]+")


def worker_id_from_url(url: str) -> str:
    """An id for a worker registered by URL alone: its host and port, in the worker-id grammar
    (proxy/identifiers.py): `http://10.0.0.5:8101` -> `10.0.0.5-8101`, `http://[::1]:9` -> `1-9`."""
    parts = urlsplit(url)
    return _NOT_IN_WORKER_ID.sub("-", parts.netloc or url).strip("-.~+@")[:MAX_WORKER_ID_CHARS] or "worker"


# A membership or report change, for listeners such as proxy/workers/redis_mirror.py's Redis mirror:
# (kind, worker, detail) with kind in register | remove | drain | report.
Listener = Callable[[str, "Worker", Any], None]


class Registry:
    """All workers, by id. Every mutation goes through a method so states stay consistent."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._workers: dict[str, Worker] = {}
        self._changed: asyncio.Future[None] | None = None
        self._listeners: list[Listener] = []
        # candidates() per model, kept until a worker's state may have changed: `_version` is bumped by
        # every method that changes membership or a state; time alone changes a state only at a stale
        # deadline or a breaker's cooldown end, and the cache is kept only until the first of those
        self._version = 0
        self._candidates: dict[str, tuple[int, float, float, list[Worker], list[Worker]]] = {}

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, kind: str, worker: Worker, detail: Any = None) -> None:
        for listener in self._listeners:
            listener(kind, worker, detail)

    # --- membership ---------------------------------------------------------------------
    def register(self, reg: WorkerRegistration, source: str = "api", *, secret_hash: str | None = None) -> Worker:
        """Add a worker, or refresh one that registers again under the same id (keeping its load).

        No ownership check here: the control plane refuses a registration that would displace a live
        worker it does not own (see `holders`); a worker with the same URL and another id is replaced.
        """
        worker_id = reg.worker_id or worker_id_from_url(reg.url)
        url = reg.url.rstrip("/")
        for other in list(self._workers.values()):  # one URL is one worker, whatever it was called
            if other.url == url and other.worker_id != worker_id:
                self.remove(other.worker_id)
        existing = self._workers.get(worker_id)
        worker = Worker(worker_id, url, reg.models, engine=reg.engine, capacity_tokens=reg.kv_capacity_tokens,
                        max_model_len=reg.max_model_len, reports=reg.reports, labels=reg.labels, source=source,
                        now=self.clock(), role=reg.role)
        if existing is not None:
            worker.load = existing.load  # in-flight requests still finish against these counters
            worker.trust = existing.trust  # registering again does not restore a liar's word
            if reg.kv_capacity_tokens:
                worker.load.capacity_tokens = reg.kv_capacity_tokens
        worker.registration = reg.model_copy(update={"worker_id": worker_id})
        worker.secret_hash = secret_hash
        worker.api_key = reg.api_key
        self._workers[worker_id] = worker
        self._version += 1
        self.notify_changed()
        self._emit("register", worker, worker.registration)
        return worker

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._version += 1
            self.notify_changed()
            self._emit("remove", worker)
        return worker

    def remove_url(self, url: str) -> Worker | None:
        url = url.rstrip("/")
        for worker in list(self._workers.values()):
            if worker.url == url:
                return self.remove(worker.worker_id)
        return None

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def holders(self, worker_id: str, url: str) -> list[Worker]:
        """Workers a registration of (worker_id, url) would replace: the one with that id, any with that URL."""
        url = url.rstrip("/")
        return [w for w in self._workers.values() if w.worker_id == worker_id or w.url == url]

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    # --- reports and health -------------------------------------------------------------
    def record_report(self, worker_id: str, report: LoadReport) -> bool:
        """Take a load report; False if the worker is unknown (it should register again)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        last = worker.last_report
        # seq counts within one registration (a new Worker, a new secret) and one boot of the worker:
        # a report from a new boot starts its own sequence; one from another boot than the registered one
        # is refused as unknown, so a live sender registers again (and a late one from a dead boot is dropped).
        booted = worker.registration.boot_id if worker.registration is not None else None
        if report.boot_id and booted and report.boot_id != booted:
            return False
        same_boot = last is not None and report.boot_id == last.boot_id
        if last is not None and same_boot and report.seq <= last.seq:
            return True  # out of order: an older report must not overwrite a newer one
        now = self.clock()
        before = worker.state(now)
        if worker.load.reading_at is not None and now - worker.load.reading_at > STALE_AFTER_S:
            # Reports resume after a silence (a partition, a paused host): the failures that opened its
            # breaker meanwhile were the silence's; its reports show it alive, so a trial goes through now
            # (not after a cooldown that doubled through the silence); a failed trial reopens it at once.
            worker.breaker.half_open()
        worker.last_report = report
        worker.reported_state = report.state
        worker.stalled_at = None  # a fresh report: it is running again
        worker.probe_failed = False
        if report.max_num_batched_tokens:
            worker.load.step_tokens = report.max_num_batched_tokens
        reading = EngineReading(report.kv_cache_usage, report.num_running, report.num_waiting,
                                report.kv_capacity_tokens or None, report.prefix_cache_hit_rate,
                                report.prompt_tokens_total, report.generation_tokens_total, report.preemptions_total)
        worker.load.record_reading(worker.trust.weigh(reading, worker.load, now, lambda: self.peer_capacity(worker)),
                                   now, "report")
        self._state_may_change(worker, before)
        self.notify_changed()
        self._emit("report", worker, report)
        return True

    def record_scrape(self, worker: Worker, reading: EngineReading | None) -> None:
        """A successful /metrics scrape or health probe of a non-reporting worker."""
        before = worker.state(self.clock())
        worker.probe_failed = False
        if reading is not None:
            now = self.clock()
            worker.load.record_reading(worker.trust.weigh(reading, worker.load, now,
                                                          lambda: self.peer_capacity(worker)), now, "metrics")
            worker.stalled_at = None  # its engine answers again: the fresh report of a worker that sends none
        self._state_may_change(worker, before)
        self.notify_changed()

    def peer_capacity(self, worker: Worker) -> int:
        """The largest KV capacity a fully trusted worker serving one of `worker`'s models reports: what a
        distrusted worker's own claim is capped at (proxy/workers/report_trust.py). Asked only for distrusted ones."""
        models = set(worker.models)
        peers = [w.load.capacity_tokens for w in self._workers.values()
                 if w is not worker and w.trust.factor >= 1.0 and any(m in models for m in w.models)]
        return max(peers, default=DEFAULT_CAPACITY_TOKENS)

    def record_probe_reading(self, worker: Worker, reading: EngineReading) -> None:
        """A reading from a one-off probe of `worker`'s engine (proxy/workers/engine_probe.py): a non-reporting worker
        takes it as a scrape; a reporting one keeps its report's reading and notes only whether its engine moved,
        which takes it back at once if it was marked stalled."""
        if not worker.reports:
            self.record_scrape(worker, reading)
            return
        if worker.load.note_progress(reading, self.clock()) and worker.stalled_at is not None:
            worker.stalled_at = None
            self._version += 1
            self.notify_changed()

    def record_probe(self, worker: Worker, ok: bool, error: str | None = None) -> None:
        before = worker.state(self.clock())
        was_failed = worker.probe_failed
        worker.probe_failed = not ok
        if not ok:
            worker.last_error = error
        if ok and was_failed:
            worker.breaker.reset()  # the worker answers again: give it traffic back at once
        self._state_may_change(worker, before)
        if was_failed != worker.probe_failed:
            self.notify_changed()

    def record_success(self, worker: Worker) -> None:
        if worker.breaker.open_until:
            self._version += 1  # a half-open circuit closes
        worker.breaker.record_success()

    def record_failure(self, worker: Worker, error: str) -> bool:
        """The forwarder saw this worker fail; True when that opened its circuit."""
        worker.last_error = error
        opened = worker.breaker.record_failure(self.clock())
        if opened:
            self._version += 1
        return opened

    def _state_may_change(self, worker: Worker, before: WorkerState) -> None:
        if worker.state(self.clock()) is not before:
            self._version += 1

    def mark_stalled(self, worker: Worker, detail: str) -> None:
        """`worker` sent nothing for its stall threshold while holding requests: no new work until it sends
        a fresh load report (proxy/dataplane/stall.py moves what it held)."""
        if worker.stalled_at is None:
            worker.stalled_at = self.clock()
            worker.last_error = detail
            self._version += 1
            self.notify_changed()

    def drain(self, worker_id: str) -> Worker | None:
        worker = self._workers.get(worker_id)
        if worker is not None and not worker.drain_requested:
            worker.drain_requested = True
            self._version += 1
            self.notify_changed()
            self._emit("drain", worker)
        return worker

    # --- questions ----------------------------------------------------------------------
    def serves(self, model: str) -> bool:
        return any(w.serves(model) for w in self._workers.values())

    def served_models(self) -> dict[str, list[Worker]]:
        out: dict[str, list[Worker]] = {}
        for worker in self._workers.values():
            for model in worker.models:
                out.setdefault(model, []).append(worker)
        return out

    def candidates(self, model: str, exclude: Iterable[str] = ()) -> list[Worker]:
        """Workers that may take a new request for `model`: ready ones, else stale ones.

        Without `exclude` the same list object comes back until a worker's state may have changed
        (callers must not modify it); a decision then costs nothing per worker of the fleet.
        """
        now = self.clock()
        cached = self._candidates.get(model)
        if cached is None or cached[0] != self._version or not cached[1] <= now < cached[2]:
            if len(self._candidates) >= MAX_CACHED_MODELS:  # names come from clients: keep memory bounded
                self._candidates.clear()
            cached = self._candidates[model] = self._scan(model, now)
        ready, stale = cached[3], cached[4]
        if exclude:
            excluded = set(exclude) if not isinstance(exclude, (set, frozenset, dict)) else exclude
            if excluded:
                return [w for w in ready if w.worker_id not in excluded] or [
                    w for w in stale if w.worker_id not in excluded]
        return ready or stale

    def _scan(self, model: str, now: float) -> tuple[int, float, float, list[Worker], list[Worker]]:
        """(version, now, valid until, ready, stale) for `model`; valid until the first time-driven change."""
        ready: list[Worker] = []
        stale: list[Worker] = []
        until = float("inf")
        for worker in self._workers.values():
            if not worker.serves(model) or worker.role == "encode":  # an encoder-only engine answers no tokens
                continue
            state = worker.state(now)
            if state is WorkerState.READY:
                ready.append(worker)
            elif state is WorkerState.STALE:
                stale.append(worker)
            open_until = worker.breaker.open_until
            if now < open_until < until:
                until = open_until  # the circuit half-opens then
            if worker.reports:
                last = worker.load.reading_at if worker.load.reading_at is not None else worker.registered_mono
                if now - last <= STALE_AFTER_S and last + STALE_AFTER_S < until:
                    until = last + STALE_AFTER_S  # it goes stale after then
        return self._version, now, until, ready, stale

    # --- change notification (wakes requests waiting in the admission queue) -------------
    def notify_changed(self) -> None:
        fut = self._changed
        if fut is not None and not fut.done():
            fut.set_result(None)
        self._changed = None

    def changed(self) -> asyncio.Future[None]:
        """A future that completes at the next report, completion, or membership change."""
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed
