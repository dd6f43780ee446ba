"""An engine's `/metrics` text read as an EngineReading: vLLM's and LMDeploy's metric names.

Owns which names are read and the bounds a scraped value must keep (those of a report, proxy/protocol.py);
does no I/O (proxy/workers/monitor.py and proxy/workers/engine_probe.py fetch the text).
"""

from __future__ import annotations

from proxy import promtext
from proxy.protocol import MAX_KV_CAPACITY_TOKENS, MAX_REQUESTS
from proxy.workers.loadview import EngineReading

# vLLM and LMDeploy names (see shared/notes/engines.md)
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "lmdeploy:gpu_cache_usage_perc")
_RUNNING = ("vllm:num_requests_running", "lmdeploy:num_requests_running")
_WAITING = ("vllm:num_requests_waiting", "lmdeploy:num_requests_waiting")
_HIT_RATE = "lmdeploy:prefix_cache_hit_rate"
_CACHE_INFO = "vllm:cache_config_info"
_PROMPT_TOKENS, _GENERATION_TOKENS = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
_PREEMPTIONS = "vllm:num_preemptions_total"
_WANTED = (*_USAGE, *_RUNNING, *_WAITING, _HIT_RATE, _CACHE_INFO, _PROMPT_TOKENS, _GENERATION_TOKENS, _PREEMPTIONS)


def parse_engine_metrics(text: str) -> EngineReading | None:
    """Read KV usage, running/waiting counts, KV size and the work counters from Prometheus text; None if absent.

    Several label sets (data-parallel ranks) combine as proxy/promtext.py rules: usage by mean,
    counts and capacity by sum. Non-finite samples (NaN, +Inf) are left out.
    """
    metrics = promtext.parse(text, names=_WANTED)
    usage = promtext.kv_usage(metrics, _USAGE)
    if usage is None:
        return None
    # what a report may say (proxy/protocol.py's bounds): an engine's /metrics is as untrusted as a report
    running = _count(sum(metrics.total(name) or 0 for name in _RUNNING))
    waiting = _count(sum(metrics.total(name) or 0 for name in _WAITING))
    hit_rate = min(max(metrics.mean(_HIT_RATE) or 0.0, 0.0), 1.0)
    capacity = promtext.kv_capacity_tokens(metrics, _CACHE_INFO)
    if capacity is not None and not 0 < capacity <= MAX_KV_CAPACITY_TOKENS:
        capacity = None
    return EngineReading(usage, running, waiting, capacity, hit_rate,
                         metrics.total(_PROMPT_TOKENS), metrics.total(_GENERATION_TOKENS), metrics.total(_PREEMPTIONS))


def _count(value: float) -> int:
    return int(min(max(value, 0), MAX_REQUESTS))
