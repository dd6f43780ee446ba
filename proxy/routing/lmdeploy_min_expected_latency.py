"""lmdeploy_min_expected_latency: LMDeploy proxy's default, for users migrating from it.

LMDeploy picks the node with the least unfinished requests divided by its speed; here
unfinished is this proxy's in-flight count and speed the worker's `speed` label (default 1).
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.workers.registry import Worker


def _speed(worker: Worker) -> float:
    try:
        return max(float(worker.labels.get("speed", 1.0)), 1e-6)
    except ValueError:
        return 1.0


class MinExpectedLatencyPolicy(Policy):
    name = "lmdeploy_min_expected_latency"

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        expected = {w.worker_id: w.load.in_flight / _speed(w) for w in candidates}
        best = min(expected.values())
        tied = [w for w in candidates if expected[w.worker_id] == best]
        worker = tied[0] if len(tied) == 1 else self.deps.rng.choice(tied)
        return Decision(worker, "min_expected_latency", request.expected_kv_tokens, expected)
