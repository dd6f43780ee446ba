"""kv_aware (default): route on what the engines report, corrected for what was just sent.

Owns the cost of sending a request to each candidate and the pick; loads come from loadview.py, cached
prefixes from prefix_index.py, candidates from candidates.py's rosters, the weights from config.yaml
(`proxy.routing.kv_aware`, routing_config.KvAwareConfig; a model's own under `models[].routing`).

    cost(w) = projected_kv_usage(w) + queue_weight * queue_depth(w) + inflight_weight * in_flight(w)
            - prefix_weight * held(w) * cached_tokens(w) / prompt_tokens
            + backlog_weight * (prefill_backlog(w) - credit(w) * cached_tokens(w)) / capacity(w)
            + evict_weight * backlog_weight * credit(evicted(w)) * evicted(w) / capacity(w)
    held(w)   = min(1, cached_tokens(w) / prefix_saturation_tokens)
                + prefix_bonus_per_step * max(0, cached_tokens(w) - step_tokens(w)) / step_tokens(w)
                (step_tokens: the engine's token budget per step; a copy of a longer prefix takes more whole steps)
    credit(t) = cached_prefill_credit + credit_per_cache_share * t / capacity(w)
    evicted(w) = the hot prefix tokens (routed there more than once, not this request's) that the request's
                 new KV pushes out of the engine's free blocks: min(hot, free) + new - free, within [0, min(hot, free)]

The lowest cost wins (ties: fewest in flight, then random). A cached prefix keeps its worker until that
worker is fuller, or has more prompt work queued to prefill, than a copy elsewhere would cost (including the
prefixes the copy evicts there); the in-flight term gives a hot prefix replicas once its holder's batch slows
every decode there. Candidates are scored in the order of their cost without the prefix and eviction terms (the
roster's key, a lower bound of a non-holder's cost): the `shortlist` least loaded, those the prefix index names,
and any further one whose key is below the best cost found; the minimum is the full scan's
(tests/proxy/routing/test_candidates.py). A pick away from a candidate caching more than half the prompt has the
reason `left_holder` (counted in kvroute:routing_decisions_total). What each term is for and the runs that set
each weight: docs/design/kv_aware.md.
"""

from __future__ import annotations

import itertools
import logging
from bisect import bisect_left
from collections.abc import Callable, Collection, Mapping, Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.routing.candidates import Candidates, Entry, LoadCost, Roster
from proxy.routing.eviction import evicted_tokens
from proxy.routing_config import KvAwareConfig, PolicyKnobs
from proxy.workers.loadview import STEP_TOKENS_ASSUMED, WorkerLoad
from proxy.workers.registry import Worker

log = logging.getLogger("kvroute.routing.kv_aware")


# The cost functions below are closures over one KvAwareConfig's weights: they run for every scored worker, and
# reading a closure's cells is ~3x cheaper than a pydantic model's attributes.
PrefixBonus = Callable[[RoutedRequest, int, int, float, int], float]
EvictCost = Callable[[float, int, int, int], float]
WorkerCost = Callable[[WorkerLoad, RoutedRequest, int, int, float], float]


def load_cost_of(knobs: KvAwareConfig) -> LoadCost:
    """cost() of a worker holding no prefix of the request, as of its load's last event (the roster's key)."""
    queue_weight, inflight_weight, backlog_weight = knobs.queue_weight, knobs.inflight_weight, knobs.backlog_weight

    def load_cost(load: WorkerLoad) -> float:
        usage, queue = load.usage_and_queue()
        return (usage + queue_weight * queue + inflight_weight * load.in_flight
                + backlog_weight * load.prefill_backlog / load.capacity_tokens)

    return load_cost


def prefix_bonus_of(knobs: KvAwareConfig) -> PrefixBonus:
    """The prefix terms of cost(): prefix_bonus(request, cached, capacity_tokens, usage, step_tokens) is what holding
    `cached` of the request's prompt tokens is worth on a worker (its KV-unit bonus, and the prefill it saves in
    backlog units; `usage`: the worker's projected KV usage; `step_tokens`: its engine's token budget per step)."""
    prefix_weight, saturation, by_share = knobs.prefix_weight, knobs.prefix_saturation_tokens, knobs.prefix_by_share
    per_step = knobs.prefix_bonus_per_step
    credit_base, per_usage, per_share = knobs.cached_prefill_credit, knobs.credit_per_usage, knobs.credit_per_cache_share
    backlog_weight = knobs.backlog_weight

    def prefix_bonus(request: RoutedRequest, cached: int, capacity_tokens: int, usage: float = 0.0,
                     step_tokens: int = STEP_TOKENS_ASSUMED) -> float:
        if not cached:
            return 0.0
        held = cached / saturation if cached < saturation else 1.0
        if per_step and cached > step_tokens:  # its copy's prefill takes more than one whole step
            held += per_step * (cached - step_tokens) / step_tokens
        bonus = prefix_weight * held
        if by_share and request.prompt_tokens > cached:
            bonus *= cached / request.prompt_tokens
        credit = credit_base + per_usage * usage + per_share * cached / capacity_tokens
        return bonus + backlog_weight * credit * cached / capacity_tokens

    return prefix_bonus


def evict_cost_of(knobs: KvAwareConfig) -> EvictCost:
    """The eviction term of cost(): evict_cost(usage, capacity_tokens, hot_tokens, new_tokens) for a worker at
    projected KV usage `usage` whose engine keeps `hot_tokens` of prefixes routed there more than once (this
    request's own cached part taken out) and is sent `new_tokens` of KV. vLLM and TurboMind keep a finished
    request's blocks among the free ones and reuse the least recently used first (eviction.py)."""
    weight = knobs.evict_weight * knobs.backlog_weight
    credit_base, per_share = knobs.cached_prefill_credit, knobs.credit_per_cache_share

    def evict_cost(usage: float, capacity: int, hot: int, new: int) -> float:
        if hot <= 0 or not weight:
            return 0.0
        share = evicted_tokens(capacity * (1.0 - usage), hot, new) / capacity
        return weight * (credit_base + per_share * share) * share

    return evict_cost


def worker_cost_of(knobs: KvAwareConfig) -> WorkerCost:
    """cost(w) of the module docstring: worker_cost(load, request, cached, hot, now) for a worker that caches
    `cached` of the request's prompt tokens and `hot` tokens of prefixes routed there more than once."""
    queue_weight, inflight_weight, backlog_weight = knobs.queue_weight, knobs.inflight_weight, knobs.backlog_weight
    prefix_bonus, evict_cost = prefix_bonus_of(knobs), evict_cost_of(knobs)

    def worker_cost(load: WorkerLoad, request: RoutedRequest, cached: int, hot: int, now: float) -> float:
        usage = load.projected_kv_usage(now)
        capacity = load.capacity_tokens
        cost = (usage + queue_weight * load.queue_depth(now) + inflight_weight * load.in_flight
                + backlog_weight * load.prefill_backlog / capacity
                - prefix_bonus(request, cached, capacity, usage, load.step_tokens or STEP_TOKENS_ASSUMED))
        if hot > cached:
            prompt = request.prompt_tokens
            new = (prompt - cached if prompt > cached else 0) + request.expected_output_tokens
            cost += evict_cost(usage, capacity, (hot if hot < capacity else capacity) - cached, new)
        return cost

    return worker_cost


def _reason(request: RoutedRequest, cached: int, cached_of: Mapping[str, int]) -> str:
    """The decision's reason: `left_holder` when a candidate caches more than half the prompt and the pick does not
    (its load outweighed the prefix: the engine prefills a copy there), else `lowest_cost`."""
    deepest = max(cached_of.values()) if cached_of else 0
    return "left_holder" if cached <= request.prompt_tokens / 2 < deepest else "lowest_cost"


class KvAwarePolicy(Policy):
    name = "kv_aware"
    config: KvAwareConfig
    load_cost: LoadCost  # the roster's order key: a new one (a knob changed) re-sorts the rosters
    worker_cost: WorkerCost

    def configure(self, knobs: PolicyKnobs) -> None:
        super().configure(knobs)
        if getattr(self, "config", None) != knobs.kv_aware:
            self.config = knobs.kv_aware
            self.load_cost, self.worker_cost = load_cost_of(self.config), worker_cost_of(self.config)

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        cached_of: dict[str, int] = {}  # worker -> prompt tokens it caches
        if request.prefix_hashes and len(candidates) > 1:
            ids = {w.worker_id for w in candidates}
            cached_of = self.deps.cached_prefix.match(request, ids, now)
        hot_of = self.deps.prefix_index.hot_by_worker()
        best: Worker | None = None
        best_key: tuple[float, int] = (float("inf"), 0)
        best_cached = 0
        ties = 0
        scores: dict[str, float] = {}
        for worker in candidates:
            load = worker.load
            cached = cached_of.get(worker.worker_id, 0)
            cost = self.worker_cost(load, request, cached, hot_of.get(worker.worker_id, 0), now)
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
                      request.prompt_tokens, self._explain(candidates, scores, cached_of, request, now),
                      best.worker_id, best_cached)
        prefill = max(0, request.prompt_tokens - best_cached)
        reason = _reason(request, best_cached, cached_of)
        return Decision(best, reason, prefill + request.expected_output_tokens, scores, prefill_tokens=prefill,
                        cached_tokens=best_cached if request.prefix_hashes and len(candidates) > 1 else None)

    def select_from(self, candidates: Candidates, request: RoutedRequest, now: float) -> Decision:
        roster = candidates.roster
        if roster is None:  # a plain list (kv_high_water on, or a retry with only stale workers left)
            return self.select(candidates.workers, request, now)
        roster.refresh(now)
        entries = roster.order(self.load_cost)
        excluded = candidates.excluded
        hot_of = self.deps.prefix_index.hot_by_worker()
        scores: dict[str, float] = {}
        # (worker, cached tokens, cost key) of every worker scored: the holders the prefix index names first
        scored: list[tuple[Worker, int, tuple[float, int]]] = []
        cached_of: dict[str, int] = {}
        if request.prefix_hashes:
            cached_of = self.deps.cached_prefix.match(request, None, now)
            for wid, cached in cached_of.items():
                member = roster.member(wid)
                if member is None or wid in excluded:
                    continue
                scores[wid] = cost = self.worker_cost(member.load, request, cached, hot_of.get(wid, 0), now)
                scored.append((member.worker, cached, (round(cost, 9), member.load.in_flight)))
        best_key = min((key for _, _, key in scored), default=None)
        # every other candidate costs its order key, plus what it would evict: walk the order while a key is
        # below the best cost found, and at least `shortlist` of them
        limit, short, i, size = self.config.shortlist, 0, 0, len(entries)
        while i < size:
            entry = entries[i]
            key = entry[:2]
            if short >= limit and best_key is not None and key >= best_key:
                break  # no later one costs less (the key is a lower bound), and only those with no eviction tie
            i += 1
            worker = entry[3].worker
            wid = worker.worker_id
            if wid in cached_of or wid in excluded:
                continue
            short += 1
            hot = hot_of.get(wid)
            if hot:  # (a worker whose reused prefixes were all forgotten stays in hot_of at 0)
                cost = self.worker_cost(entry[3].load, request, 0, hot, now)
                key = (round(cost, 9), entry[1])
            scores[wid] = key[0]
            scored.append((worker, 0, key))
            if best_key is None or key < best_key:
                best_key = key
        assert best_key is not None
        tied = [(w, cached) for w, cached, key in scored if key == best_key]
        if i < size and entries[i][:2] == best_key:
            # the tie at the minimum may reach past what was scored: pick among all of it, as select() would
            best, best_cached = self._among_tied(roster, entries, i, best_key, tied, cached_of, excluded, request,
                                                 hot_of, now)
        else:  # ties: each of the tied workers equally likely
            best, best_cached = tied[int(self.deps.rng.random() * len(tied))] if len(tied) > 1 else tied[0]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model=%s prompt_tokens=%d scored %d of %d candidates: %s -> %s (cached %d tokens)",
                      request.model, request.prompt_tokens, len(scored), len(candidates),
                      self._explain([w for w, _, _ in scored], scores, cached_of, request, now), best.worker_id,
                      best_cached)
        prefill = max(0, request.prompt_tokens - best_cached)
        reachable = {wid: cached for wid, cached in cached_of.items() if wid not in excluded and roster.member(wid)}
        reason = _reason(request, best_cached, reachable)
        return Decision(best, reason, prefill + request.expected_output_tokens, scores, prefill_tokens=prefill,
                        cached_tokens=best_cached if request.prefix_hashes else None)

    def _among_tied(self, roster: Roster, entries: Sequence[Entry], scanned: int, key: tuple[float, int],
                    tied: Sequence[tuple[Worker, int]], cached_of: dict[str, int], excluded: Collection[str],
                    request: RoutedRequest, hot_of: Mapping[str, int], now: float) -> tuple[Worker, int]:
        """(worker, cached tokens) uniformly among the candidates whose cost key is `key`: the `tied` ones scored
        (entries before `scanned`), and the unscanned non-holders in the order's range of that load key that
        would evict nothing (the others cost more than their key)."""
        hi = bisect_left(entries, (key[0], key[1] + 1))
        costlier: set[str] = set()  # unscanned members of the range that are not tied candidates there
        for wid in itertools.chain(excluded, cached_of, (w for w, hot in hot_of.items() if hot)):
            member = roster.member(wid)
            if member is None or member.key is None or member.key[:2] != key or wid in costlier:
                continue
            if bisect_left(entries, member.key) < scanned:
                continue  # scanned already: among `tied` if it ties
            if (wid in excluded or wid in cached_of
                    or round(self.worker_cost(member.load, request, 0, hot_of[wid], now), 9) != key[0]):
                costlier.add(wid)
        rng = self.deps.rng
        pick = rng.randrange(len(tied) + (hi - scanned) - len(costlier))
        if pick < len(tied):
            return tied[pick]
        while True:  # uniform over the range's candidates: draw until one is (most are)
            worker = entries[scanned + rng.randrange(hi - scanned)][3].worker
            if worker.worker_id not in costlier:
                return worker, 0

    def on_dispatch(self, decision: Decision, request: RoutedRequest, now: float) -> None:
        self.deps.cached_prefix.insert(request, decision.worker.worker_id, now)

    def _explain(self, candidates: Sequence[Worker], scores: dict[str, float], cached_of: dict[str, int],
                 request: RoutedRequest, now: float) -> str:
        """Each scored candidate's terms, and `ttft~`: the first-token time they predict there, the prompt
        tokens queued to prefill ahead of the request plus its own uncached part at that worker's learnt
        prefill cost (estimator.py; what its reports say, the priors before any)."""
        parts = []
        for w in candidates:
            load = w.load
            cached = cached_of.get(w.worker_id, 0)
            uncached = max(0, request.prompt_tokens - cached)
            media = request.media_tokens * uncached // request.prompt_tokens if request.media_tokens else 0
            ttft = self.deps.estimator.for_worker(w.worker_id).prefill_s(load.prefill_backlog + uncached, media)
            parts.append(f"{w.worker_id}: cost={scores[w.worker_id]:.4f} ttft~{ttft * 1000:.0f}ms "
                         f"kv={load.projected_kv_usage(now):.3f} queue={load.queue_depth(now)} "
                         f"backlog={load.prefill_backlog} cached={cached} "
                         f"hot={self.deps.prefix_index.hot_tokens(w.worker_id)}")
        return "; ".join(parts)
