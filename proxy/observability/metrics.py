"""The proxy's Prometheus metrics (prefix `kvroute:`), one CollectorRegistry per app.

Owns metric definitions, the per-worker gauges read from the registry at scrape time, and dropping a
removed worker's label sets; events are recorded by the layer where they happen (dispatch, upstream).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.identifiers import MAX_WORKER_ID_CHARS, is_model_name
from proxy.routing.engine_blocks import EngineBlocks
from proxy.workers.registry import Registry, Worker, WorkerState

# Distinct model names that get their own metrics label; further ones, and every name no worker
# serves (typos, made-up names: clients choose them), are counted as OTHER.
MAX_MODEL_LABELS = 64
OTHER = "other"
# No label value is longer: each lives in /metrics for good, and every scrape copies them all. The
# identifiers a label carries (worker ids, served model names) are bounded at registration already.
MAX_LABEL_VALUE_CHARS = max(MAX_WORKER_ID_CHARS, 256)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _CachedLabels:
    """`labels(*values)` answered from a dict of the children already made: prometheus_client takes a lock,
    str()s and checks every value on each call, several times per request on the data plane."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._children: dict[tuple[Any, ...], Any] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **named: Any) -> Any:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc]
        child = self._children.get(values)
        if child is None:
            if any(len(str(v)) > MAX_LABEL_VALUE_CHARS for v in values):
                # bounded here too, whoever records: a long value becomes OTHER (and is not a cache key)
                values = tuple(OTHER if len(str(v)) > MAX_LABEL_VALUE_CHARS else v for v in values)
                return self.labels(*values)
            child = self._children[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove(self, *values: Any) -> None:
        self._children.clear()  # keyed by the values as given, which may differ from their str()
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._children.clear()
        super().clear()  # type: ignore[misc]


class CachedCounter(_CachedLabels, Counter):
    pass


class CachedHistogram(_CachedLabels, Histogram):
    pass


class ProxyMetrics:
    """Counters and histograms the request path updates, plus worker gauges computed on scrape."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._model_labels: set[str] = set()
        self.collector_registry = CollectorRegistry(auto_describe=False)
        r = self.collector_registry
        self.requests = CachedCounter("kvroute:requests", "Requests finished, by model, worker and status",
                                ["model", "worker", "status"], registry=r)
        self.latency = CachedHistogram("kvroute:request_latency_seconds", "Request received -> response finished",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = CachedHistogram("kvroute:time_to_first_byte_seconds",
                              "Request received -> first response byte sent to the client (TTFT for streams)",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = CachedCounter("kvroute:routing_decisions", "Routing decisions, by policy, worker and reason",
                                 ["policy", "worker", "reason"], registry=r)
        self.retries = CachedCounter("kvroute:retries", "Requests moved to another worker before the first byte",
                               ["model", "reason"], registry=r)
        self.rejections = CachedCounter("kvroute:rejections", "Requests answered with an error by the proxy itself",
                                  ["model", "reason"], registry=r)
        self.stream_failures = CachedCounter("kvroute:stream_failures", "Streams a worker broke after the first byte",
                                       ["model", "worker"], registry=r)
        self.migrations = CachedCounter("kvroute:migrations", "Streams handed to another worker after their worker failed "
                                  "mid-stream (continued), ended with an error event (failed), non-streamed "
                                  "requests started again elsewhere after their worker broke (restarted), and "
                                  "streams longer than proxy.limits.max_migration_text_bytes (text_limit: not movable)",
                                  ["model", "outcome"], registry=r)
        self.redis_events_dropped = CachedCounter(
            "kvroute:redis_dropped", "Events and worker entries read from Redis that were malformed or not allowed "
            "(dropped, never applied), by reason", ["reason"], registry=r)
        # The data plane's self-protection (proxy/dataplane/gate.py, exchange.py, migration.py)
        self.bad_responses = CachedCounter("kvroute:bad_upstream_responses", "Worker answers HTTP does not allow "
                                           "(unreadable, oversized or invalid head), never relayed", ["worker"],
                                           registry=r)
        self.connections_shed = CachedCounter("kvroute:client_connections_shed", "Client connections refused "
                                              "(total_cap, per_client_cap) or closed idle early (idle_under_pressure)",
                                              ["reason"], registry=r)
        self.client_connections = Gauge("kvroute:client_connections", "Open client connections", registry=r)
        self.accept_pauses = Counter("kvroute:accept_pauses", "Times accepting connections paused: file descriptors "
                                     "near the process limit", registry=r)
        self.accepting = Gauge("kvroute:accepting", "1 while new client connections are accepted, 0 while paused",
                               registry=r)
        r.register(_WorkerGauges(registry))
        # Worker ids churn (a new generation per restart): a removed worker's label sets go with it, or
        # /metrics would grow for as long as the proxy runs.
        self._per_worker: tuple[tuple[CachedCounter, tuple[str, ...]], ...] = (
            (self.requests, ("model", "worker", "status")), (self.decisions, ("policy", "worker", "reason")),
            (self.stream_failures, ("model", "worker")), (self.bad_responses, ("worker",)))
        registry.add_listener(self._on_registry_change)


    def watch_engine_blocks(self, engine_blocks: EngineBlocks) -> None:
        """Export what the engines' KV events told the proxy (per worker, read at scrape time)."""
        self.collector_registry.register(_EngineBlockGauges(engine_blocks))

    def model_label(self, name: str) -> str:
        """A requested model `name` as a label: itself when a worker serves it (while few distinct names were
        seen), else OTHER. Each label value lives in /metrics for good, and clients choose these names."""
        if name in self._model_labels:
            return name
        if (len(self._model_labels) < MAX_MODEL_LABELS and isinstance(name, str) and is_model_name(name)
                and self._registry.serves(name)):
            self._model_labels.add(name)
            return name
        return OTHER

    def redis_dropped(self, reason: str) -> None:
        self.redis_events_dropped.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.collector_registry)

    def forget_worker(self, worker_id: str) -> None:
        """Remove every label set that names `worker_id`."""
        for metric, names in self._per_worker:  # names: in the order .labels() takes them
            stale = {tuple(sample.labels[n] for n in names)
                     for family in metric.collect() for sample in family.samples
                     if sample.labels.get("worker") == worker_id}
            for values in stale:
                metric.remove(*values)

    def _on_registry_change(self, kind: str, worker: Worker, detail: object) -> None:
        if kind == "remove":
            self.forget_worker(worker.worker_id)


class _WorkerGauges(Collector):
    """Per-worker state read from the registry when /metrics is scraped (no bookkeeping per event)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        now = self.registry.clock()
        in_flight = GaugeMetricFamily("kvroute:worker_in_flight", "Requests in flight to the worker", labels=["worker"])
        kv = GaugeMetricFamily("kvroute:worker_kv_usage", "KV cache usage the worker last reported (0..1)",
                               labels=["worker"])
        projected = GaugeMetricFamily("kvroute:worker_projected_kv_usage",
                                      "Reported KV usage plus what was dispatched since", labels=["worker"])
        waiting = GaugeMetricFamily("kvroute:worker_queue", "Requests waiting at the worker (last report)",
                                    labels=["worker"])
        running = GaugeMetricFamily("kvroute:worker_running", "Requests running at the worker (last report)",
                                    labels=["worker"])
        state = GaugeMetricFamily("kvroute:worker_state", "1 for the worker's current state", labels=["worker", "state"])
        role = GaugeMetricFamily("kvroute:worker_role", "1 for the worker's role (both, prefill, decode, encode)",
                                 labels=["worker", "role"])
        trust = GaugeMetricFamily("kvroute:worker_report_trust", "How far the worker's readings are believed (1: fully; "
                                  "0: routed on the proxy's own counts; proxy/workers/report_trust.py)", labels=["worker"])
        for worker in self.registry.workers():
            wid = worker.worker_id
            load = worker.load
            in_flight.add_metric([wid], load.in_flight)
            projected.add_metric([wid], load.projected_kv_usage(now))
            if load.reading is not None:
                kv.add_metric([wid], load.reading.kv_usage)
                waiting.add_metric([wid], load.reading.num_waiting)
                running.add_metric([wid], load.reading.num_running)
            trust.add_metric([wid], worker.trust.factor)
            current = worker.state(now)
            for s in WorkerState:
                state.add_metric([wid, s.value], 1.0 if s is current else 0.0)
            role.add_metric([wid, worker.role], 1.0)
        yield from (in_flight, kv, projected, waiting, running, state, role, trust)


class _EngineBlockGauges(Collector):
    """Each reporting engine's prefix cache as its KV events describe it (proxy/routing/engine_blocks.py)."""

    def __init__(self, engine_blocks: EngineBlocks) -> None:
        self.engine_blocks = engine_blocks

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily("kvroute:worker_kv_event_blocks",
                                   "Blocks the worker's engine caches, as its KV events said", labels=["worker"])
        view = GaugeMetricFamily("kvroute:worker_kv_event_view",
                                 "1 for the state of the proxy's view of the engine's cache: exact (routing uses "
                                 "it), incomplete (events were lost, or how the engine names blocks is not known yet) "
                                 "or awaiting (a snapshot)", labels=["worker", "state"])
        resyncs = CounterMetricFamily("kvroute:worker_kv_event_resyncs",
                                      "Times the view was found stale (a lost batch, a restart) and a snapshot asked",
                                      labels=["worker"])
        for v in self.engine_blocks.views():
            blocks.add_metric([v.worker_id], len(v.blocks))
            current = "exact" if v.exact else "awaiting" if not v.synced else "incomplete"
            for state in ("exact", "incomplete", "awaiting"):
                view.add_metric([v.worker_id, state], 1.0 if state == current else 0.0)
            resyncs.add_metric([v.worker_id], v.resyncs)
        yield from (blocks, view, resyncs)
