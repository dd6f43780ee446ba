"""Conditional disaggregation without fixed pools: a pool of `both` workers that each run a KV connector as both
producer and consumer (`kv_role: kv_both`, vLLM's NIXL default) may prefill a request on one worker and decode it
on another.

Owns FlexiblePolicy, the wrapper a flexible model's requests get (split.py's SplitFleet says which models are
flexible), and FlexibleFleet, which keeps one per model. The model's configured policy (kv_aware by default) places
each request as on any aggregated fleet; then disagg.plan compares running it whole there with prefilling it on
another worker of the pool and moving its KV over, that placed worker being the only decoder. A split wins only
when predicted sooner at less cost to the requests decoding: typically a long cold prompt placed on a worker
whose decoding streams its prefill would stall, while another worker decodes fewer. The legs then run exactly as
a fixed P/D pool's (proxy/dataplane/stages.py), failures included. Arithmetic: docs/design/disaggregation.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.routing.candidates import Candidates
from proxy.routing.disagg import RequestView, WorkerView, plan, view_of
from proxy.routing.kv_cost import predict
from proxy.routing.live import LiveConfig
from proxy.routing.split import SplitFleet, SplitPolicy, flexible_worker
from proxy.routing.stage_plan import ENCODE
from proxy.workers.registry import Worker

log = logging.getLogger("kvroute.routing.disagg")


class FlexiblePolicy(SplitPolicy):
    """The configured policy's placement, with the prefill moved to another worker of the pool when sooner."""

    def __init__(self, inner: Policy, fleet: SplitFleet, model: str) -> None:
        self.inner = inner
        super().__init__(inner.deps, fleet.knobs_for(model), fleet, model)

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        return self._prefill_elsewhere(self.inner.select(candidates, request, now), candidates, request, now)

    def select_from(self, candidates: Candidates, request: RoutedRequest, now: float) -> Decision:
        placed = self.inner.select_from(candidates, request, now)
        return self._prefill_elsewhere(placed, candidates.workers, request, now)

    def _prefill_elsewhere(self, placed: Decision, candidates: Sequence[Worker], request: RoutedRequest,
                           now: float) -> Decision:
        target = placed.worker
        if request.prompt_tokens < 2 or not flexible_worker(target):
            return placed
        donors = [w for w in candidates if w is not target and flexible_worker(w)]
        if not donors:
            return placed
        config, deps = self.config, self.deps
        ids = [target.worker_id] + [w.worker_id for w in donors]
        cached = deps.cached_prefix.match(request, ids, now)
        if len(donors) > config.shortlist_above:  # a shortlist, plus every worker holding some of the prompt
            sampled = deps.rng.sample(donors, config.shortlist)
            donors = sampled + [w for w in donors if w.worker_id in cached and w not in sampled]
        pool = [target, *donors]
        snapshots = [w.load.snapshot(now) for w in pool]
        fleet_waiting = max(s.reported_waiting for s in snapshots)
        hot = deps.prefix_index.hot_by_worker()
        output = request.expected_output_tokens
        views: list[WorkerView] = []
        for w, snap in zip(pool, snapshots, strict=True):
            wid = w.worker_id
            model = deps.estimator.for_worker(wid)
            held = cached.get(wid, 0)
            queue_s = predict(w, model, request, held, hot.get(wid, 0), now, fleet_waiting).queue_s
            # prompts sent there that have not produced output yet are prefilled first, reported running or not
            # (a prefill leg's engine admits it at once and computes it in chunks: no report shows it waiting)
            ahead = model.s_per_token * w.load.prefill_backlog
            if ahead > queue_s:
                queue_s = ahead
            view = view_of(wid, "both", snap, model, queue_s, held, output)  # decoding: what its engine runs
            # the placed worker is the only one that may decode it; every other may only prefill for it
            views.append(view if w is target else replace(view, role="prefill"))
        wanted = RequestView(request.prompt_tokens, request.media_tokens, (), output)
        explain = log.isEnabledFor(logging.DEBUG)
        chosen = plan(wanted, views, self.fleet.link(self.model), explain=explain,
                      slowdown=self.config.stall_cost == "slowdown")
        if chosen.kind == "aggregated":
            return placed
        if explain:
            log.debug("model=%s prompt_tokens=%d placed on %s by %s -> %s; terms %s; passed over: %s", request.model,
                      request.prompt_tokens, target.worker_id, self.inner.name, chosen.describe(),
                      " ".join(f"{k}={v:.4g}" for k, v in chosen.terms.items()),
                      "; ".join(f"{label} (cost {cost * 1000:.1f} ms)" for label, cost in chosen.alternatives))
        return self._decision(chosen, pool, [], request, (), cached)

    def on_dispatch(self, decision: Decision, request: RoutedRequest, now: float) -> None:
        if decision.reason != ENCODE:  # whole, decode leg or prefill leg: that worker's engine caches the prompt
            self.inner.on_dispatch(decision, request, now)
        if decision.plan is not None:
            super().on_dispatch(decision, request, now)

    def on_finish(self, decision: Decision, request: RoutedRequest, sent_at: float, first_byte_at: float | None,
                  ended_at: float) -> None:
        self.inner.on_finish(decision, request, sent_at, first_byte_at, ended_at)
        if decision.plan is not None:
            super().on_finish(decision, request, sent_at, first_byte_at, ended_at)


class FlexibleFleet:
    """One FlexiblePolicy per flexible model, over the model's current configured policy."""

    def __init__(self, split: SplitFleet) -> None:
        self.split = split
        self._policies: dict[str, FlexiblePolicy] = {}
        split.live.follow(self._follow)

    def _follow(self, live: LiveConfig) -> None:
        for model, policy in self._policies.items():
            knobs = self.split.knobs_for(model)
            if policy.knobs != knobs:
                policy.configure(knobs)

    def policy_for(self, served: str, inner: Policy) -> FlexiblePolicy:
        policy = self._policies.get(served)
        if policy is None or policy.inner is not inner:
            if len(self._policies) > len(self.split.flexible):  # models that left
                self._policies = {m: p for m, p in self._policies.items() if m in self.split.flexible}
            policy = self._policies[served] = FlexiblePolicy(inner, self.split, served)
        return policy
