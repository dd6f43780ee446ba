"""A vLLM engine's recent speed (prefill tokens/s, decode step time) from the histograms in its /metrics.

Owns turning vLLM's cumulative histogram sums into rates over a recent window; the adapter (vllm.py)
puts them into the load reports, and the proxy's estimator (proxy/routing/estimator.py) learns from them.

- Prefill rate = (tokens computed in prefill) / (time requests spent in prefill), both summed over the
  requests whose prefill ended in the window: `vllm:request_prefill_kv_computed_tokens_sum` (new KV,
  cached tokens excluded) over `vllm:request_prefill_time_seconds_sum`. vLLM versions without the first
  histogram: `vllm:prompt_tokens_total` less `vllm:prefix_cache_hits_total`. The ratio of sums is the
  token-weighted mean of each request's own seconds per token, the latency a request's prefill sees in
  the batches the engine really runs (chunked prefill beside decodes included), which is what the
  routing model's per-request prefill term means.
- Decode step = mean inter-token latency: `vllm:inter_token_latency_seconds` (older versions:
  `vllm:time_per_output_token_seconds`), delta of `_sum` over delta of `_count`.
- Window: a rate is recomputed once at least MIN_PREFILLS prefills (MIN_STEPS decode steps) ended since
  the reading it is measured from, and at most WINDOW_S ago; until then the last rate is reported
  again, and None before the first (the proxy then keeps its priors). Data-parallel ranks are summed.
  Counters that go backwards (engine restart) restart the window.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proxy.promtext import Metrics

PREFILL_TOKENS = "vllm:request_prefill_kv_computed_tokens_sum"
PREFILL_TIME = "vllm:request_prefill_time_seconds_sum"
PREFILL_COUNT = "vllm:request_prefill_time_seconds_count"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
METRIC_NAMES = (PREFILL_TOKENS, PREFILL_TIME, PREFILL_COUNT, PROMPT_TOKENS, PREFIX_HITS,
                *(name + suffix for name in ITL_NAMES for suffix in ("_sum", "_count")))

MIN_PREFILLS = 4
MIN_STEPS = 32
WINDOW_S = 30.0


class _Rate:
    """numerator / denominator over the deltas since a baseline reading, re-based once enough happened."""

    __slots__ = ("min_events", "_base", "value")

    def __init__(self, min_events: int) -> None:
        self.min_events = min_events
        self._base: tuple[float, float, float, float] | None = None  # (at, numerator, denominator, events)
        self.value: float | None = None

    def update(self, now: float, numerator: float | None, denominator: float | None, events: float | None) -> None:
        if numerator is None or denominator is None or events is None:
            return
        base = self._base
        if base is None or events < base[3] or numerator < base[1] or denominator < base[2]:
            self._base = (now, numerator, denominator, events)  # first reading, or the engine restarted
            return
        d_num, d_den, d_events = numerator - base[1], denominator - base[2], events - base[3]
        if d_events >= self.min_events and d_den > 0:
            self.value = d_num / d_den
            self._base = (now, numerator, denominator, events)
        elif now - base[0] > WINDOW_S and d_events == 0:
            self._base = (now, numerator, denominator, events)  # idle: start the next window afresh


class VllmSpeed:
    """Feed it each parsed /metrics reading; read prefill_tokens_per_s and decode_step_s (None: not known yet)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._prefill = _Rate(MIN_PREFILLS)
        self._decode = _Rate(MIN_STEPS)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        value = self._prefill.value
        return value if value is not None and value > 0 else None

    @property
    def decode_step_s(self) -> float | None:
        value = self._decode.value
        return value if value is not None and value > 0 else None

    def update(self, metrics: Metrics) -> None:
        now = self._clock()
        computed = metrics.total(PREFILL_TOKENS)
        if computed is None:
            prompt, hits = metrics.total(PROMPT_TOKENS), metrics.total(PREFIX_HITS)
            computed = None if prompt is None else prompt - (hits or 0.0)
        self._prefill.update(now, computed, metrics.total(PREFILL_TIME), metrics.total(PREFILL_COUNT))
        for name in ITL_NAMES:
            count = metrics.total(name + "_count")
            if count is not None:
                # steps are the events; the rate is seconds per step (sum / count)
                self._decode.update(now, metrics.total(name + "_sum"), count, count)
                break
