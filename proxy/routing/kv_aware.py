"""kv_aware (default): route on what the engines report, corrected for what was just sent.

For each candidate worker w (all below the KV high-water mark, see dispatch.py):

    cost(w) = projected_kv_usage(w)                      # loadview: reported + pending / capacity
            + QUEUE_WEIGHT  * queue_depth(w)             # reported num_waiting + sent since report
            - PREFIX_WEIGHT * min(1, cached_tokens(w) / PREFIX_SATURATION_TOKENS)

and the request goes to the lowest cost (ties: fewest in flight, then random). cached_tokens is
the estimated prompt tokens (text and images) the prefix index says w has seen most recently.
Defaults: QUEUE_WEIGHT 0.02 (50 queued requests weigh like a full cache), PREFIX_WEIGHT 1.0
(1024 reused prompt tokens are worth a whole cache of KV usage), PREFIX_SATURATION_TOKENS 1024.
So a shared system prompt or a reused image keeps its worker until that worker is much fuller
than another (the high-water mark still caps it), and the expected KV a request adds on w
excludes the part w already caches. PREFIX_WEIGHT was 0.3 at first: bench/quality.py showed a
256-token image then worth only 0.075, so image questions scattered, every worker prefilled the
same images again and at 95% load 224 of 1047 VQA requests were refused; at 1.0 none were and
goodput went from 35% to 98%, with chat and the two-model mix unchanged
(bench/results/2026-11-29-quality.md, rows kv_aware@prefix_weight=1.0).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from proxy.registry import Worker
from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy

log = logging.getLogger("kvroute.routing.kv_aware")

QUEUE_WEIGHT = 0.02
PREFIX_WEIGHT = 1.0
PREFIX_SATURATION_TOKENS = 1024


def cached_tokens(request: RoutedRequest, depth: int) -> int:
    """Estimated prompt tokens covered by the first `depth` prefix blocks."""
    return request.prefix_tokens[depth - 1] if depth > 0 else 0


class KvAwarePolicy(Policy):
    name = "kv_aware"

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        depths: dict[str, int] = {}
        if request.prefix_hashes and len(candidates) > 1:
            ids = {w.worker_id for w in candidates}
            depths = self.deps.prefix_index.match(request.prefix_hashes, ids, now)
        best: Worker | None = None
        best_key: tuple[float, int] = (float("inf"), 0)
        best_cached = 0
        ties = 0
        scores: dict[str, float] = {}
        for worker in candidates:
            load = worker.load
            cached = cached_tokens(request, depths.get(worker.worker_id, 0))
            cost = (load.projected_kv_usage(now) + QUEUE_WEIGHT * load.queue_depth(now)
                    - PREFIX_WEIGHT * min(1.0, cached / PREFIX_SATURATION_TOKENS))
            scores[worker.worker_id] = cost
            key = (round(cost, 9), load.in_flight)
            if key < best_key:
                best, best_key, best_cached, ties = worker, key, cached, 1
            elif key == best_key:
                # reservoir sampling: each of the tied workers is equally likely
                ties += 1
                if self.deps.rng.random() * ties < 1.0:
                    best, best_cached = worker, cached
        assert best is not None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model=%s prompt_tokens=%d candidates=%s -> %s (cached %d tokens)", request.model,
                      request.prompt_tokens, self._explain(candidates, scores, depths, request, now),
                      best.worker_id, best_cached)
        kv_tokens = max(0, request.prompt_tokens - best_cached) + request.expected_output_tokens
        return Decision(best, "lowest_cost", kv_tokens, scores)

    def on_dispatch(self, decision: Decision, request: RoutedRequest, now: float) -> None:
        if request.prefix_hashes:
            self.deps.prefix_index.insert(request.prefix_hashes, decision.worker.worker_id, now)

    @staticmethod
    def _explain(candidates: Sequence[Worker], scores: dict[str, float], depths: dict[str, int],
                 request: RoutedRequest, now: float) -> str:
        return "; ".join(
            f"{w.worker_id}: cost={scores[w.worker_id]:.4f} kv={w.load.projected_kv_usage(now):.3f} "
            f"queue={w.load.queue_depth(now)} cached={cached_tokens(request, depths.get(w.worker_id, 0))}"
            for w in candidates)
