"""random: a uniformly random candidate (named random_choice.py so it does not shadow `random`).

Owns nothing but that rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.workers.registry import Worker


class RandomPolicy(Policy):
    name = "random"

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        return Decision(self.deps.rng.choice(list(candidates)), "random", request.expected_kv_tokens)
