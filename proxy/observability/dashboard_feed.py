"""The dashboard's live feed: once a second, one JSON frame of the fleet (per model and per worker).

Owns sampling the proxy's own counters into a short history (rates, TTFT quantiles, errors over
the last minutes) and fanning frames out to a bounded set of listeners; it reads the registry,
the metrics and the fleet manager, changes nothing, and holds no secrets (no tokens, no labels,
no credentials in URLs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from proxy.observability.metrics import ProxyMetrics
from proxy.observability.worker_states import explain_state
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.dashboard")

RATE_WINDOW_S = 10.0      # req/s: requests finished over the last 10 s
TTFT_WINDOW_S = 60.0      # TTFT p50/p99 over the last minute
ERROR_WINDOW_S = 300.0    # errors and rejections over the last 5 minutes
HISTORY_S = 300.0
SERIES_POINTS = 60        # the per-model request-rate sparkline: one point per second


class TooManyListeners(Exception):
    """The feed already serves its maximum number of live pages."""


@dataclass
class _ModelCounts:
    ok: float = 0.0
    errors: float = 0.0
    rejected: float = 0.0
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # cumulative, upper bound -> count


@dataclass
class _Sample:
    at: float
    models: dict[str, _ModelCounts]
    dispatched: dict[str, int]


class DashboardFeed:
    """Samples every `interval_s`; `frame()` is the latest picture, `listen()` streams new ones."""

    def __init__(self, registry: Registry, metrics: ProxyMetrics, queue_lengths: Callable[[], dict[str, int]],
                 fleet_snapshot: Callable[[], dict[str, Any] | None] = lambda: None, *,
                 interval_s: float = 1.0, max_listeners: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.metrics = metrics
        self.queue_lengths = queue_lengths
        self.fleet_snapshot = fleet_snapshot
        self.interval_s = interval_s
        self.max_listeners = max_listeners
        self.clock = clock
        self._history: deque[_Sample] = deque(maxlen=int(HISTORY_S / interval_s) + 2)
        self._listeners: set[asyncio.Queue[bytes]] = set()
        self._frame: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dashboard-feed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        import orjson

        while True:
            try:
                self.sample()
                if self._listeners:
                    data = orjson.dumps(self.frame())
                    for queue in self._listeners:
                        if queue.full():  # a slow page gets the newest frame, never a backlog
                            queue.get_nowait()
                        queue.put_nowait(data)
            except Exception:  # the dashboard must never take the proxy down
                log.exception("dashboard sample failed")
            await asyncio.sleep(self.interval_s)

    # --- listeners (one per open page; bounded) ---------------------------------------------------
    def add_listener(self) -> asyncio.Queue[bytes]:
        """A queue that receives each new frame (JSON bytes); hand it back with remove_listener."""
        if len(self._listeners) >= self.max_listeners:
            raise TooManyListeners(f"{self.max_listeners} dashboards are already open")
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)
        self._listeners.add(queue)
        return queue

    def remove_listener(self, queue: asyncio.Queue[bytes]) -> None:
        self._listeners.discard(queue)

    @property
    def listeners(self) -> int:
        return len(self._listeners)

    # --- sampling ------------------------------------------------------------------------------
    def sample(self) -> None:
        models: dict[str, _ModelCounts] = {}
        for family in self.metrics.requests.collect():
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                counts = models.setdefault(s.labels["model"], _ModelCounts())
                status = s.labels["status"]
                if status.startswith("2"):
                    counts.ok += s.value
                elif status != "client_closed":
                    counts.errors += s.value
        for family in self.metrics.rejections.collect():
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("reason") != "no_healthy_worker":
                    # no_healthy_worker is also counted as a 503 request above
                    models.setdefault(s.labels["model"], _ModelCounts()).rejected += s.value
        for family in self.metrics.ttft.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    counts = models.setdefault(s.labels["model"], _ModelCounts())
                    counts.ttft_buckets[float(s.labels["le"])] = s.value
        dispatched = {w.worker_id: w.load.dispatched_total for w in self.registry.workers()}
        self._history.append(_Sample(self.clock(), models, dispatched))
        self._frame = None

    def _ago(self, seconds: float) -> _Sample | None:
        """The oldest sample no older than `seconds` before the newest (None with fewer than two)."""
        if len(self._history) < 2:
            return None
        newest = self._history[-1].at
        for sample in self._history:
            if newest - sample.at <= seconds + self.interval_s / 2:
                return sample if sample is not self._history[-1] else None
        return None

    # --- the frame -----------------------------------------------------------------------------
    def frame(self) -> dict[str, Any]:
        if self._frame is None:
            if not self._history:
                self.sample()
            self._frame = self._build()
        return self._frame

    def _build(self) -> dict[str, Any]:
        now_mono = self.registry.clock()
        now_wall = time.time()
        fleet = _safe_fleet(self.fleet_snapshot)
        replicas = {r.get("worker_id"): r for r in (fleet or {}).get("replicas", [])}
        worker_rate = self._worker_rates()
        workers = [self._worker_row(w, now_mono, now_wall, replicas.get(w.worker_id), worker_rate.get(w.worker_id))
                   for w in self.registry.workers()]
        seen = {w["id"] for w in workers}
        for wid, rep in replicas.items():  # started by `kvroute up` but not (or no longer) registered
            if wid not in seen and rep.get("state") not in ("stopped",):
                workers.append(_replica_only_row(rep, now_wall))
        workers.sort(key=lambda w: (w["model"], w["id"]))
        queues = self.queue_lengths()
        model_names = sorted({w["model"] for w in workers} | set(queues) | self._sampled_models()
                             | {m["name"] for m in (fleet or {}).get("models", [])})
        desired = {m["name"]: m for m in (fleet or {}).get("models", [])}
        models = [self._model_row(name, workers, queues.get(name, 0), desired.get(name)) for name in model_names]
        return {"at": now_wall, "interval_s": self.interval_s, "managed": fleet is not None,
                "models": models, "workers": workers,
                "windows": {"rate_s": RATE_WINDOW_S, "ttft_s": TTFT_WINDOW_S, "errors_s": ERROR_WINDOW_S}}

    def _sampled_models(self) -> set[str]:
        return set(self._history[-1].models) if self._history else set()

    def _worker_rates(self) -> dict[str, float]:
        old = self._ago(5.0)
        if old is None:
            return {}
        new = self._history[-1]
        span = new.at - old.at
        return {wid: max(n - old.dispatched.get(wid, n), 0) / span for wid, n in new.dispatched.items()} if span else {}

    def _worker_row(self, w: Worker, now: float, wall: float, replica: dict[str, Any] | None,
                    rate: float | None) -> dict[str, Any]:
        load = w.load
        reading = load.reading
        age = None if load.reading_at is None else now - load.reading_at
        state = w.state(now).value
        reason = explain_state({"state": state, "breaker_open": w.breaker.is_open(now), "last_error": w.last_error,
                                "reading_age_s": age, "last_report": {"state": w.reported_state}})
        reported_engine = w.last_report.engine if w.last_report is not None else w.engine
        configured = (replica or {}).get("engine") or w.engine
        gpus = (replica or {}).get("gpus") or (w.registration.gpus if w.registration else [])
        started = (replica or {}).get("started_at") or w.registered_at
        return {
            "id": w.worker_id, "model": w.models[0] if w.models else "?", "models": list(w.models),
            "state": state, "reason": reason, "engine": configured, "effective_engine": reported_engine,
            "role": w.role, "host": _host(w.url), "gpus": [str(g) for g in gpus],
            "kv": None if reading is None else round(reading.kv_usage, 4),
            "kv_projected": round(min(load.projected_kv_usage(now), 9.99), 4),
            "kv_capacity_tokens": load.capacity_tokens,
            "running": None if reading is None else reading.num_running,
            "waiting": None if reading is None else reading.num_waiting,
            "in_flight": load.in_flight,
            "prefix_hit_rate": None if reading is None else round(reading.prefix_cache_hit_rate, 4),
            "req_per_s": None if rate is None else round(rate, 2),
            "uptime_s": max(0.0, round(wall - started, 1)) if started else None,
            "restarts": (replica or {}).get("restarts"), "report_age_s": None if age is None else round(age, 2),
        }

    def _model_row(self, name: str, workers: list[dict[str, Any]], queued: int,
                   desired: dict[str, Any] | None) -> dict[str, Any]:
        mine = [w for w in workers if w["model"] == name]
        new = self._history[-1].models.get(name, _ModelCounts()) if self._history else _ModelCounts()

        def delta(window: float) -> tuple[_ModelCounts, float]:
            old = self._ago(window)
            if old is None:
                return _ModelCounts(), 0.0
            return old.models.get(name, _ModelCounts()), self._history[-1].at - old.at

        old_rate, rate_span = delta(RATE_WINDOW_S)
        old_ttft, _ = delta(TTFT_WINDOW_S)
        old_err, err_span = delta(ERROR_WINDOW_S)
        finished = (new.ok + new.errors) - (old_rate.ok + old_rate.errors)
        buckets = {le: n - old_ttft.ttft_buckets.get(le, 0.0) for le, n in new.ttft_buckets.items()}
        return {
            "name": name, "workers": len(mine), "ready": sum(w["state"] == "ready" for w in mine),
            "desired": desired.get("desired_replicas") if desired else None,
            "pooled": bool(desired and desired.get("pools")),  # scaled per pool: `kvroute scale --role`
            "req_per_s": round(finished / rate_span, 2) if rate_span else 0.0,
            "ttft_p50_s": _quantile(buckets, 0.50), "ttft_p99_s": _quantile(buckets, 0.99),
            "errors": int(new.errors - old_err.errors), "rejected": int(new.rejected - old_err.rejected),
            "errors_window_s": round(err_span), "queued": queued,
            "series": self._series(name),
        }

    def _series(self, name: str) -> list[float]:
        """Requests finished per second for the last SERIES_POINTS samples (oldest first)."""
        hist = list(self._history)[-(SERIES_POINTS + 1):]
        out = []
        for a, b in zip(hist, hist[1:], strict=False):
            ca, cb = a.models.get(name, _ModelCounts()), b.models.get(name, _ModelCounts())
            span = b.at - a.at
            out.append(round(max((cb.ok + cb.errors) - (ca.ok + ca.errors), 0.0) / span, 2) if span else 0.0)
        return out


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets; None when nothing was observed."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return round(prev_bound, 4)
            inside = count - prev_count
            frac = (rank - prev_count) / inside if inside > 0 else 1.0
            return round(prev_bound + (bound - prev_bound) * frac, 4)
        prev_bound, prev_count = bound, count
    return round(prev_bound, 4)


def _host(url: str) -> str:
    """host[:port] without any user:password@ a URL may carry."""
    parts = urlsplit(url)
    return parts.hostname + (f":{parts.port}" if parts.port else "") if parts.hostname else url


def _safe_fleet(source: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    try:
        return source()
    except Exception:
        log.exception("reading the fleet manager failed")
        return None


def _replica_only_row(rep: dict[str, Any], wall: float) -> dict[str, Any]:
    started = rep.get("started_at")
    reason = rep.get("last_error") or ("starting its engine" if rep.get("state") == "starting" else "")
    return {"id": rep.get("worker_id"), "model": rep.get("model") or "?", "models": [rep.get("model")],
            "state": rep.get("state"), "reason": reason, "engine": rep.get("engine"),
            "effective_engine": rep.get("engine"), "role": rep.get("role") or "both", "host": _host(rep.get("url") or "") if rep.get("url") else "-",
            "gpus": [str(g) for g in rep.get("gpus") or []], "kv": None, "kv_projected": None,
            "kv_capacity_tokens": None, "running": None, "waiting": None, "in_flight": 0, "prefix_hit_rate": None,
            "req_per_s": None, "uptime_s": max(0.0, round(wall - started, 1)) if started else None,
            "restarts": rep.get("restarts"), "report_age_s": None}
