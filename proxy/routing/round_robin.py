"""round_robin: each candidate in turn, per model.

Owns one counter per model; the order follows the registry's (registration) order.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy, PolicyDeps
from proxy.routing_config import PolicyKnobs
from proxy.workers.registry import Worker


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, deps: PolicyDeps, knobs: PolicyKnobs | None = None) -> None:
        super().__init__(deps, knobs)
        self._next: dict[str, int] = {}

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        return Decision(candidates[turn % len(candidates)], "round_robin", request.expected_kv_tokens)
