"""The routing interface: a policy picks one worker among candidates for one request.

Owns the Policy base class, the Decision it returns, and the name -> policy factory; it does
not filter candidates (dispatch passes only workers that may take work) and does no I/O.
"""

from __future__ import annotations

import importlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from proxy.registry import Worker
from proxy.request import RoutedRequest
from proxy.routing.cached_prefix import CachedPrefix
from proxy.routing.candidates import Candidates
from proxy.routing.engine_blocks import EngineBlocks
from proxy.routing.estimator import FleetEstimator
from proxy.routing.prefix_index import PrefixIndex

# name -> "module:Class". Adding a policy: one new file and one line here.
POLICIES: dict[str, str] = {
    "kv_cost": "proxy.routing.kv_cost:KvCostPolicy",
    "kv_aware": "proxy.routing.kv_aware:KvAwarePolicy",
    "prefix": "proxy.routing.prefix:PrefixPolicy",
    "least_requests": "proxy.routing.least_requests:LeastRequestsPolicy",
    "power_of_two": "proxy.routing.power_of_two:PowerOfTwoPolicy",
    "round_robin": "proxy.routing.round_robin:RoundRobinPolicy",
    "random": "proxy.routing.random_choice:RandomPolicy",
    "session": "proxy.routing.session:SessionPolicy",
    "lmdeploy_min_expected_latency": "proxy.routing.lmdeploy_min_expected_latency:MinExpectedLatencyPolicy",
}


@dataclass(slots=True)
class Decision:
    """The chosen worker and why; `kv_tokens` is the KV the request is expected to add there."""

    worker: Worker
    reason: str
    kv_tokens: int
    scores: dict[str, float] | None = None
    # kv_cost: what the model predicted on the chosen worker, for learning from what happens
    prefill_tokens: int = 0  # prompt tokens the worker is expected to compute (not in its cache)
    media_tokens: int = 0  # of those, image/video tokens
    predicted_queue_s: float = 0.0
    predicted_ttft_s: float | None = None
    cold_prefill_s: float | None = None  # the prefill of the whole prompt there (as on a worker without its prefix)


@dataclass
class PolicyDeps:
    """What policies may share: the prefix indexes, the learnt per-worker parameters, a random source.

    `cached_prefix` answers how much of a prompt each worker caches (the engines' own KV events where they
    publish them, `prefix_index` elsewhere); `engine_blocks` is fed by the registry (app.py adds it as a listener).
    """

    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    rng: random.Random = field(default_factory=random.Random)
    estimator: FleetEstimator = field(default_factory=FleetEstimator)
    engine_blocks: EngineBlocks = field(default_factory=EngineBlocks)
    cached_prefix: CachedPrefix = field(init=False)

    def __post_init__(self) -> None:
        self.cached_prefix = CachedPrefix(self.prefix_index, self.engine_blocks)


class Policy(ABC):
    """Pick a worker. `candidates` is never empty; every candidate serves the request's model."""

    name: ClassVar[str]

    def __init__(self, deps: PolicyDeps) -> None:
        self.deps = deps

    @abstractmethod
    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        ...

    def select_from(self, candidates: Candidates, request: RoutedRequest, now: float) -> Decision:
        """select() as admission calls it: a policy that need not see every candidate overrides this
        (kv_aware reads the roster's load order); `candidates` is never empty."""
        return self.select(candidates.workers, request, now)

    def on_dispatch(self, decision: Decision, request: RoutedRequest, now: float) -> None:
        """Called once the request is sent to decision.worker (hook for cache-aware policies)."""
        return None

    def on_finish(self, decision: Decision, request: RoutedRequest, sent_at: float, first_byte_at: float | None,
                  ended_at: float) -> None:
        """Called once the attempt is over (monotonic times; first_byte_at None: no byte came back)."""
        return None

    # shared helpers -----------------------------------------------------------------------
    def least_in_flight(self, candidates: Sequence[Worker]) -> Worker:
        best = min(w.load.in_flight for w in candidates)
        tied = [w for w in candidates if w.load.in_flight == best]
        return tied[0] if len(tied) == 1 else self.deps.rng.choice(tied)


def policy_names() -> list[str]:
    return list(POLICIES)


def make_policy(name: str, deps: PolicyDeps) -> Policy:
    """Instantiate a policy by name; ValueError naming the known ones for an unknown name."""
    target = POLICIES.get(name)
    if target is None:
        raise ValueError(f"unknown routing policy '{name}'; known: {', '.join(POLICIES)}")
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(deps)
