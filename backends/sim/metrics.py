"""Prometheus exposition of the sim engine with vLLM v1's metric names and labels.

Owns the per-server CollectorRegistry: gauges and counters are read from the engine at scrape
time (so /metrics always agrees with its state); latency histograms are observed when requests
finish. It does not change engine state.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.sim.encoder import EncoderCounters
from backends.sim.engine import SimEngine
from backends.sim.scheduler import SimRequest
from backends.sim.transfer import KvHolder, TransferCounters

# vLLM's own bucket boundaries (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineStateCollector(Collector):
    """Gauges and counters straight from the engine, at scrape time."""

    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name, "engine": "0"}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        sched, kv = self.engine.scheduler, self.engine.kv
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv.usage)
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          len(sched.running))
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          len(sched.waiting))
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            sched.num_preemptions)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            sched.prefix_queries_tokens)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            sched.prefix_hit_tokens)
        yield self._counter("vllm:request_success", "Count of successfully processed requests.", sched.num_finished)
        # as vLLM counts them: a prompt when its prefill completes, generated tokens step by step
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", sched.num_prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            sched.num_generated_tokens)
        # not vLLM's: how much simulated time the host lost (a benchmark with a large ratio of lag to
        # busy time measured the host, not the model)
        yield self._counter("kvroute:sim_busy_seconds", "Simulated seconds the engine spent in steps.",
                            self.engine.busy_sim_s)
        yield self._counter("kvroute:sim_lag_seconds", "Simulated seconds lost because the host fell behind.",
                            self.engine.lag_sim_s)
        info = InfoMetricFamily("vllm:cache_config", "Information of the LLMEngine CacheConfig")
        info.add_metric([], {"block_size": str(kv.block_size), "num_gpu_blocks": str(kv.num_blocks),
                             "enable_prefix_caching": str(kv.enable_prefix_caching),
                             "cache_dtype": "auto", "engine": "0"})
        yield info


class _DisaggCollector(Collector):
    """The KV hand-over and the encoder cache (backends/sim/transfer.py, encoder.py), at scrape time: vLLM's NIXL
    names where it has one (nixl_num_failed_transfers, nixl_num_kv_expired_reqs), kvroute:sim_* otherwise."""

    def __init__(self, holder: KvHolder | None, transfer: TransferCounters, encoder: EncoderCounters,
                 labels: dict[str, str]) -> None:
        self.holder, self.transfer, self.encoder, self.labels = holder, transfer, encoder, labels

    def _family(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
                value: float) -> Metric:
        family = kind(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        t, e, gauge, counter = self.transfer, self.encoder, GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "kvroute:sim_kv_blocks_held_for_transfer",
                           "KV blocks of finished prefill requests waiting for a decode worker to pull them",
                           self.holder.blocks_held if self.holder else 0)
        yield self._family(counter, "kvroute:sim_kv_transfers_sent", "KV transfers sent to decode workers",
                           t.transfers_sent)
        yield self._family(counter, "kvroute:sim_kv_transfers_received", "KV transfers pulled from prefill workers",
                           t.transfers_received)
        yield self._family(counter, "kvroute:sim_kv_transfer_bytes_sent", "KV bytes sent", t.bytes_sent)
        yield self._family(counter, "kvroute:sim_kv_transfer_bytes_received", "KV bytes received", t.bytes_received)
        yield self._family(counter, "vllm:nixl_num_failed_transfers", "KV pulls that failed", t.failed_pulls)
        yield self._family(counter, "vllm:nixl_num_kv_expired_reqs",
                           "Requests whose held KV was freed unpulled when its lease ran out", t.lease_timeouts)
        yield self._family(counter, "kvroute:sim_encoder_cache_hits", "Media items found in the encoder cache",
                           e.cache_hits)
        yield self._family(counter, "kvroute:sim_encoder_cache_misses", "Media items the vision tower encoded",
                           e.cache_misses)
        yield self._family(counter, "kvroute:sim_encoder_outputs_sent", "Encoder outputs sent to other workers",
                           e.outputs_sent)
        yield self._family(counter, "kvroute:sim_encoder_outputs_received", "Encoder outputs fetched from an "
                           "encode worker", e.outputs_received)


class SimMetrics:
    """The /metrics registry of one sim server."""

    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStateCollector(engine, model_name))
        # children made now, so every series exists (at 0) from the first scrape, as in vLLM
        labels = ["model_name", "engine"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name, "0")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name, "0")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name, "0")
        engine.finish_listeners.append(self.observe_finished)

    def add_disagg(self, holder: KvHolder | None, transfer: TransferCounters, encoder: EncoderCounters) -> None:
        self.registry.register(_DisaggCollector(holder, transfer, encoder, {"model_name": self.model_name,
                                                                            "engine": "0"}))

    def observe_finished(self, request: SimRequest) -> None:
        """Latencies in simulated seconds (what the simulated GPU would show)."""
        if request.first_token_time is None or request.finish_time is None:
            return
        self.ttft.observe(request.first_token_time - request.arrival_time)
        self.e2e.observe(request.finish_time - request.arrival_time)
        if request.num_output_tokens > 1:
            itl = (request.finish_time - request.first_token_time) / (request.num_output_tokens - 1)
            self.itl.observe(itl)

    def render(self) -> bytes:
        return generate_latest(self.registry)

