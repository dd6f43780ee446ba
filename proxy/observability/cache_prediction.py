"""The proxy's routing accuracy in /metrics: per worker, the cached tokens it predicted against those the engine's
answers reported, and the models whose tokenizer the engines' answers contradicted.

Owns these metric families, read at scrape time from the registry's workers (Worker.cache_prediction) and from
proxy/routing/cache_feedback.py; nothing is recorded per request here, and a removed worker's series go with it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.routing.cache_feedback import CacheFeedback
from proxy.workers.registry import Registry


class CachePredictionMetrics(Collector):
    def __init__(self, registry: Registry, feedback: CacheFeedback) -> None:
        self.registry = registry
        self.feedback = feedback

    def collect(self) -> Iterator[Metric]:
        answers = CounterMetricFamily(
            "kvroute:worker_cache_answers", "Answers whose cached tokens were compared with the proxy's prediction, "
            "by where the prediction came from (exact: the engine's KV events; approximate: the prefix index)",
            labels=["worker", "source"])
        predicted = CounterMetricFamily("kvroute:worker_cache_predicted_tokens",
                                        "Prompt tokens the proxy predicted the worker had cached, over those answers",
                                        labels=["worker"])
        actual = CounterMetricFamily("kvroute:worker_cache_actual_tokens",
                                     "Prompt tokens the worker's engine reported cached (usage.prompt_tokens_details."
                                     "cached_tokens), over those answers", labels=["worker"])
        error = CounterMetricFamily("kvroute:worker_cache_prediction_error_tokens",
                                    "Sum of |predicted - actual| cached tokens over those answers", labels=["worker"])
        corrections = CounterMetricFamily(
            "kvroute:worker_prefix_index_corrections", "Times an answer corrected the approximate prefix index: the "
            "engine had evicted what it believed (evicted) or reused more (reused)", labels=["worker", "kind"])
        for worker in self.registry.workers():
            stats = worker.cache_prediction
            if stats is None:
                continue
            wid = worker.worker_id
            answers.add_metric([wid, "exact"], stats.exact_answers)
            answers.add_metric([wid, "approximate"], stats.answers - stats.exact_answers)
            predicted.add_metric([wid], stats.predicted_tokens)
            actual.add_metric([wid], stats.actual_tokens)
            error.add_metric([wid], stats.abs_error_tokens)
            corrections.add_metric([wid, "evicted"], stats.evicted)
            corrections.add_metric([wid, "reused"], stats.reused)
        mismatches = CounterMetricFamily(
            "kvroute:tokenizer_mismatches", "Times the engines' answers showed the proxy's tokenizer for a model does "
            "not count as they do (the model is then counted by estimate)", labels=["model"])
        for model, n in self.feedback.mismatches.items():
            mismatches.add_metric([model], n)
        yield from (answers, predicted, actual, error, corrections, mismatches)
