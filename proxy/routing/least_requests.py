"""least_requests: the worker with the fewest requests in flight from this proxy (ties at random).

Owns nothing but that rule; it reads no engine load (kv_aware does).
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.workers.registry import Worker


class LeastRequestsPolicy(Policy):
    name = "least_requests"

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        return Decision(self.least_in_flight(candidates), "least_in_flight", request.expected_kv_tokens)
