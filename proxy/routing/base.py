"""The routing interface: a policy picks one worker among candidates for one request.

Owns the Policy base class, the Decision it returns, the name -> policy factory, and which policy object
with which knobs serves each model (assign_policies); it does not filter candidates (dispatch passes only
workers that may take work) and does no I/O.
"""

from __future__ import annotations

import importlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from proxy.config import FleetConfig
from proxy.request import RoutedRequest
from proxy.routing.cached_prefix import CachedPrefix
from proxy.routing.candidates import Candidates
from proxy.routing.engine_blocks import EngineBlocks
from proxy.routing.estimator import FleetEstimator
from proxy.routing.prediction import KvCostPrediction
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing.stage_plan import StagePlan
from proxy.routing_config import PolicyKnobs, RoutingConfig
from proxy.workers.registry import Worker

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
    """The chosen worker and why; `kv_tokens` is the KV the request is expected to add there.

    `prefill_tokens`: the prompt tokens the worker is expected to compute (not in its cache), counted in its
    prefill backlog; 0 from policies that do not estimate what a worker caches. `cached_tokens`: the prompt tokens
    the policy believed the worker caches (None: it did not look), which the engine's answer is compared with
    (cache_feedback.py). `scores`: each scored
    candidate's cost, for debugging and traces (None: the policy does not score). A policy's own predictions
    travel in their own type: `prediction` (kv_cost's and split's; None from every other policy). `plan`: the
    stages before this worker's, when a disaggregated model's request is split or encoded elsewhere first.
    """

    worker: Worker
    reason: str
    kv_tokens: int
    scores: dict[str, float] | None = None
    prefill_tokens: int = 0
    prediction: KvCostPrediction | None = None
    cached_tokens: int | None = None
    plan: StagePlan | None = None  # a disaggregated model's other stages (proxy/routing/split.py); None: run it whole


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

    def configure(self, routing: RoutingConfig) -> None:
        """Take the fleet-wide knobs of a (new) config; what the index and the estimator hold is kept."""
        self.prefix_index.configure(routing.prefix_index)
        self.estimator.configure(routing.estimator)


class Policy(ABC):
    """Pick a worker. `candidates` is never empty; every candidate serves the request's model."""

    name: ClassVar[str]

    def __init__(self, deps: PolicyDeps, knobs: PolicyKnobs | None = None) -> None:
        self.deps = deps
        self.knobs = PolicyKnobs()
        self.configure(knobs or self.knobs)

    def configure(self, knobs: PolicyKnobs) -> None:
        """Take new knobs (a config edit): from the next decision on, keeping whatever the policy has learnt.
        A policy with knobs of its own overrides this to read its section of `knobs`."""
        self.knobs = knobs

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


def make_policy(name: str, deps: PolicyDeps, knobs: PolicyKnobs | None = None) -> Policy:
    """Instantiate a policy by name (with `knobs`, else the defaults); ValueError naming the known ones for an
    unknown name."""
    target = POLICIES.get(name)
    if target is None:
        raise ValueError(f"unknown routing policy '{name}'; known: {', '.join(POLICIES)}")
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(deps, knobs)


def assign_policies(config: FleetConfig, global_policy: str, deps: PolicyDeps, old_default: Policy | None = None,
                    old_by_model: dict[str, Policy] | None = None) -> tuple[Policy, dict[str, Policy]]:
    """The policy of every model without its own (named `global_policy`, with proxy.routing's knobs), and of each
    model whose `policy` or `routing` differs from those; `deps` take the fleet-wide knobs.

    A config edit passes the running policies (`old_*`): the one that served a model keeps serving it where its
    name is unchanged, given the new knobs (what it learnt stays). ValueError for an unknown name, before
    anything changes."""
    models = [(m.name, m.policy or global_policy, m.routing) for m in config.models]
    for name in dict.fromkeys([global_policy, *(name for _, name, _ in models)]):
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy '{name}'; known: {', '.join(POLICIES)}")
    routing = config.proxy.routing
    deps.configure(routing)
    claimed: set[int] = set()

    def renew(name: str, knobs: PolicyKnobs, old: Policy | None) -> Policy:
        if old is None or old.name != name or id(old) in claimed:
            return make_policy(name, deps, knobs)
        claimed.add(id(old))
        if old.knobs != knobs:
            old.configure(knobs)
        return old

    fleet_knobs = routing.for_model(None)
    default = renew(global_policy, fleet_knobs, old_default)
    by_model: dict[str, Policy] = {}
    old_by_model = old_by_model or {}
    for model, name, own in models:
        knobs = routing.for_model(own)
        if name != global_policy or knobs != fleet_knobs:
            by_model[model] = renew(name, knobs, old_by_model.get(model, old_default))
    return default, by_model
