"""kv_aware (default): route on what the engines report, corrected for what was just sent.

Owns the cost of sending a request to each candidate and the pick; loads come from loadview.py, cached
prefixes from prefix_index.py, candidates from candidates.py's rosters, the weights from config.yaml
(`proxy.routing.kv_aware`, routing_config.KvAwareConfig; a model's own under `models[].routing`).

    cost(w) = projected_kv_usage(w) + queue_weight * queue_depth(w) + inflight_weight * in_flight(w)
            - prefix_weight * min(1, cached_tokens(w) / prefix_saturation_tokens) * cached_tokens(w) / prompt_tokens
            + backlog_weight * (prefill_backlog(w) - credit(w) * cached_tokens(w)) / capacity(w)
    credit(w) = cached_prefill_credit + credit_per_cache_share * cached_tokens(w) / capacity(w)

The lowest cost wins (ties: fewest in flight, then random). A cached prefix keeps its worker until that
worker is fuller, or has more prompt work queued to prefill, than a copy elsewhere would cost; the in-flight
term gives a hot prefix replicas once its holder's batch slows every decode there. Only the `shortlist` least
loaded workers (by the cost without the prefix term, the roster's key) and those the prefix index names are
scored: the minimum is the full scan's (tests/proxy/routing/test_candidates.py). What each term is for and the runs
that set each weight: docs/design/kv_aware.md.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Collection, Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.routing.candidates import Candidates, Entry, LoadCost, Roster
from proxy.routing_config import KvAwareConfig, PolicyKnobs
from proxy.workers.loadview import WorkerLoad
from proxy.workers.registry import Worker

log = logging.getLogger("kvroute.routing.kv_aware")


# The cost functions below are closures over one KvAwareConfig's weights: they run for every scored worker, and
# reading a closure's cells is ~3x cheaper than a pydantic model's attributes.
PrefixBonus = Callable[[RoutedRequest, int, int, float], float]
WorkerCost = Callable[[WorkerLoad, RoutedRequest, int, float], float]


def load_cost_of(knobs: KvAwareConfig) -> LoadCost:
    """cost() of a worker holding no prefix of the request, as of its load's last event (the roster's key)."""
    queue_weight, inflight_weight, backlog_weight = knobs.queue_weight, knobs.inflight_weight, knobs.backlog_weight

    def load_cost(load: WorkerLoad) -> float:
        usage, queue = load.usage_and_queue()
        return (usage + queue_weight * queue + inflight_weight * load.in_flight
                + backlog_weight * load.prefill_backlog / load.capacity_tokens)

    return load_cost


def prefix_bonus_of(knobs: KvAwareConfig) -> PrefixBonus:
    """The prefix terms of cost(): prefix_bonus(request, cached, capacity_tokens, usage) is what holding `cached` of
    the request's prompt tokens is worth on a worker (its KV-unit bonus, and the prefill it saves in backlog units;
    `usage`: the worker's projected KV usage)."""
    prefix_weight, saturation, by_share = knobs.prefix_weight, knobs.prefix_saturation_tokens, knobs.prefix_by_share
    credit_base, per_usage, per_share = knobs.cached_prefill_credit, knobs.credit_per_usage, knobs.credit_per_cache_share
    backlog_weight = knobs.backlog_weight

    def prefix_bonus(request: RoutedRequest, cached: int, capacity_tokens: int, usage: float = 0.0) -> float:
        if not cached:
            return 0.0
        bonus = prefix_weight * min(1.0, cached / saturation)
        if by_share and request.prompt_tokens > cached:
            bonus *= cached / request.prompt_tokens
        credit = credit_base + per_usage * usage + per_share * cached / capacity_tokens
        return bonus + backlog_weight * credit * cached / capacity_tokens

    return prefix_bonus


def worker_cost_of(knobs: KvAwareConfig) -> WorkerCost:
    """cost(w) of the module docstring: worker_cost(load, request, cached, now) for a worker that caches `cached` of
    the request's prompt tokens."""
    queue_weight, inflight_weight, backlog_weight = knobs.queue_weight, knobs.inflight_weight, knobs.backlog_weight
    prefix_bonus = prefix_bonus_of(knobs)

    def worker_cost(load: WorkerLoad, request: RoutedRequest, cached: int, now: float) -> float:
        usage = load.projected_kv_usage(now)
        return (usage + queue_weight * load.queue_depth(now) + inflight_weight * load.in_flight
                + backlog_weight * load.prefill_backlog / load.capacity_tokens
                - prefix_bonus(request, cached, load.capacity_tokens, usage))

    return worker_cost


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
        best: Worker | None = None
        best_key: tuple[float, int] = (float("inf"), 0)
        best_cached = 0
        ties = 0
        scores: dict[str, float] = {}
        for worker in candidates:
            load = worker.load
            cached = cached_of.get(worker.worker_id, 0)
            cost = self.worker_cost(load, request, cached, now)
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
        return Decision(best, "lowest_cost", prefill + request.expected_output_tokens, scores, prefill_tokens=prefill,
                        cached_tokens=best_cached if request.prefix_hashes and len(candidates) > 1 else None)

    def select_from(self, candidates: Candidates, request: RoutedRequest, now: float) -> Decision:
        roster = candidates.roster
        if roster is None:  # a plain list (kv_high_water on, or a retry with only stale workers left)
            return self.select(candidates.workers, request, now)
        roster.refresh(now)
        entries = roster.order(self.load_cost)
        excluded = candidates.excluded
        scores: dict[str, float] = {}
        # the workers the prefix index names: scored as select() scores them
        cached_of: dict[str, int] = {}
        holders: list[tuple[Worker, int, tuple[float, int]]] = []  # (worker, cached tokens, cost key)
        if request.prefix_hashes:
            cached_of = self.deps.cached_prefix.match(request, None, now)
            for wid, cached in cached_of.items():
                member = roster.member(wid)
                if member is None or wid in excluded:
                    continue
                load = member.load
                cost = self.worker_cost(load, request, cached, now)
                scores[wid] = cost
                holders.append((member.worker, cached, (round(cost, 9), load.in_flight)))
        # every other candidate costs its order key: the first `shortlist` of them are the cheapest
        shortlist: list[Entry] = []
        limit = self.config.shortlist
        i, size = 0, len(entries)
        while len(shortlist) < limit and i < size:
            entry = entries[i]
            i += 1
            wid = entry[3].worker.worker_id
            if wid not in cached_of and wid not in excluded:
                shortlist.append(entry)
                scores[wid] = entry[0]
        best_key = shortlist[0][:2] if shortlist else holders[0][2]
        for holder in holders:
            if holder[2] < best_key:
                best_key = holder[2]
        tied_holders = [(w, cached) for w, cached, key in holders if key == best_key] if holders else []
        tied_short = 0  # the shortlist is sorted: its ties at the minimum are its first entries
        for entry in shortlist:
            if entry[0] != best_key[0] or entry[1] != best_key[1]:
                break
            tied_short += 1
        tied = len(tied_holders) + tied_short
        if tied_short == limit:
            # the tie at the minimum may reach past the shortlist: pick among all of it, as select() would
            best, best_cached = self._among_tied(roster, entries, best_key, tied_holders, cached_of, excluded)
        elif tied == 1:
            best, best_cached = tied_holders[0] if tied_holders else (shortlist[0][3].worker, 0)
        else:  # ties: each of the tied workers equally likely
            k = int(self.deps.rng.random() * tied)
            best, best_cached = tied_holders[k] if k < len(tied_holders) else (shortlist[k - len(tied_holders)][3].worker, 0)
        if log.isEnabledFor(logging.DEBUG):
            scored = [w for w, _, _ in holders] + [e[3].worker for e in shortlist]
            log.debug("model=%s prompt_tokens=%d scored %d of %d candidates: %s -> %s (cached %d tokens)",
                      request.model, request.prompt_tokens, len(scored), len(candidates),
                      self._explain(scored, scores, cached_of, request, now), best.worker_id, best_cached)
        prefill = max(0, request.prompt_tokens - best_cached)
        return Decision(best, "lowest_cost", prefill + request.expected_output_tokens, scores, prefill_tokens=prefill,
                        cached_tokens=best_cached if request.prefix_hashes else None)

    def _among_tied(self, roster: Roster, entries: Sequence[Entry], key: tuple[float, int],
                    tied_holders: Sequence[tuple[Worker, int]], cached_of: dict[str, int],
                    excluded: Collection[str]) -> tuple[Worker, int]:
        """(worker, cached tokens) uniformly among the candidates whose cost key is `key`: the holders
        given, and the untried non-holders in the order's range of that load key."""
        lo = bisect_left(entries, key)
        hi = bisect_left(entries, (key[0], key[1] + 1))
        outside = 0  # members in [lo, hi) that are not tied candidates there: tried, or holders (scored apart)
        for wid in {*excluded, *cached_of}:
            member = roster.member(wid)
            if member is not None and member.key is not None and member.key[:2] == key:
                outside += 1
        rng = self.deps.rng
        pick = rng.randrange(len(tied_holders) + (hi - lo) - outside)
        if pick < len(tied_holders):
            return tied_holders[pick]
        while True:  # uniform over the range's candidates: draw until one is (most are)
            worker = entries[lo + rng.randrange(hi - lo)][3].worker
            if worker.worker_id not in excluded and worker.worker_id not in cached_of:
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
                         f"backlog={load.prefill_backlog} cached={cached}")
        return "; ".join(parts)
