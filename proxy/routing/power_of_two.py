"""power_of_two: sample two workers at random, send to the one with fewer requests in flight.

Owns nothing but that rule; O(1) per request whatever the fleet size.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.workers.registry import Worker


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], "only_candidate", request.expected_kv_tokens)
        first, second = self.deps.rng.sample(list(candidates), 2)
        worker = first if first.load.in_flight <= second.load.in_flight else second
        return Decision(worker, "power_of_two", request.expected_kv_tokens)
