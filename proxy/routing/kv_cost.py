"""kv_cost (opt-in; kv_aware stays the default until kv_cost wins bench quality): send each request where its predicted time to first token, plus what it costs others, is lowest.

Owns the decision model in time units; the parameters it uses are learnt in estimator.py and the
prefix bookkeeping lives in prefix_index.py. It does no I/O and never refuses (admission.py holds).

    cost(w) = ttft(w) + evict(w) + delay(w)
    ttft(w) = queue(w) + prefill(w)   # prompts ahead and the wait for KV or a batch slot, then the uncached part
    evict(w)                          # prefill later requests pay again for hot prefixes this one pushes out of w
    delay(w)                          # while the fleet queues: this request's prefill work x the requests behind it

Every term is a time learnt per worker, so nothing needs a hand-tuned weight. Costs within `resolution_s` are
equal (then lowest projected KV usage, fewest in flight, random). A hot prefix stays with its owner until a
copy is predicted faster (reason "replica"). Above `shortlist_above` candidates, `shortlist` random ones plus the
prefix holders are scored (`proxy.routing.kv_cost`, routing_config.KvCostConfig). The pick's own predictions go
with its Decision as a KvCostPrediction. Each term's formula and why: docs/design/decision-model.md.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Collection, Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy, PolicyDeps
from proxy.routing.candidates import Candidates
from proxy.routing.estimator import WorkerModel
from proxy.routing.eviction import evicted_tokens
from proxy.routing.prediction import KvCostPrediction
from proxy.routing_config import KvCostConfig, PolicyKnobs
from proxy.workers.loadview import LoadSnapshot
from proxy.workers.registry import Worker

log = logging.getLogger("kvroute.routing.kv_cost")

_RANDBELOW = getattr(random.Random, "_randbelow_with_getrandbits", None)
_NOT_ANY: frozenset[str] = frozenset()


def sample_by_set_above(k: int) -> int:
    """The population size above which random.sample(population, k) draws indices into a set."""
    return 21 + 4 ** math.ceil(math.log(k * 3, 4))


class Prediction:
    """The model's terms for one request on one worker (seconds, tokens)."""

    __slots__ = ("queue_s", "prefill_s", "evict_s", "delay_s", "cached", "uncached", "media_uncached")

    def __init__(self, queue_s: float, prefill_s: float, evict_s: float, delay_s: float, cached: int, uncached: int,
                 media_uncached: int) -> None:
        self.queue_s = queue_s
        self.prefill_s = prefill_s
        self.evict_s = evict_s
        self.delay_s = delay_s
        self.cached = cached
        self.uncached = uncached
        self.media_uncached = media_uncached

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def cost_s(self) -> float:
        return self.queue_s + self.prefill_s + self.evict_s + self.delay_s


_Terms = tuple[float, float, float, float, int, int, int, float]


def predict(worker: Worker, model: WorkerModel, request: RoutedRequest, cached: int, hot_tokens: int,
            now: float, fleet_waiting: int = 0) -> Prediction:
    """The module docstring's formulas for `request` on `worker`."""
    return Prediction(*_terms(worker.load.snapshot(now), model, request.prompt_tokens, request.media_tokens,
                              request.expected_output_tokens, request.expected_kv_tokens, cached, hot_tokens, now,
                              fleet_waiting)[:7])


def _terms(load: LoadSnapshot, model: WorkerModel, prompt: int, media: int, output: int, expected_kv: int,
           cached: int, hot_tokens: int, now: float, fleet_waiting: int
           ) -> _Terms:
    """predict() as (queue_s, prefill_s, evict_s, delay_s, cached, uncached, media_uncached, cost_s): arithmetic only."""
    # the engine's surely-waiting requests (not admission's "may be waiting": requests sent since a report of no
    # queue and without output yet are prefilling more often than not, and pending_prefill prices them already)
    used, waiting, backlog, capacity = load.used, load.waiting, load.queued, load.capacity
    kv_bar = model.mean_kv_tokens or float(expected_kv)
    prefill_bar = model.mean_prefill_tokens or float(prompt)
    # (conditional expressions instead of min/max: the same values, without a call each)
    if prompt > 1:  # the last token is always computed
        if cached > prompt - 1:
            cached = prompt - 1
    else:
        cached = 0
    uncached = prompt - cached
    media_uncached = media * uncached // prompt if media else 0
    need = uncached + output
    committed = used + load.pending_kv + waiting * kv_bar

    bias, s_tok, s_vis = model.params()
    # what the proxy sent since the reading has been prefilled since the first of it arrived
    oldest = load.oldest_pending_at
    pending_prefill_s = s_tok * load.pending_prefill
    if oldest is not None:
        pending_prefill_s -= now - oldest
        if not pending_prefill_s > 0.0:
            pending_prefill_s = 0.0
    prefill_ahead = pending_prefill_s + s_tok * waiting * prefill_bar
    # What the new request waits for KV on: while the engine queues, everything committed there; otherwise only
    # what the engine itself reports held, for the prompt alone (its first token needs all of its KV). One that
    # admits frees and allocates block by block faster than the proxy's estimates of the others can follow.
    short = committed + need - capacity if waiting or backlog else used + uncached - capacity
    if backlog or short > 0:
        turnover = model.request_turnover_s(output)
        kv_wait = short * turnover / (kv_bar if kv_bar > used else used) if short > 0 else 0.0
        if backlog:
            running = load.running
            seq_wait = backlog * turnover / (running if running > 1 else 1)
            queue = prefill_ahead + (seq_wait if seq_wait > kv_wait else kv_wait)
        else:
            queue = prefill_ahead + kv_wait
    else:
        queue = prefill_ahead + 0.0

    free = capacity - committed
    evicted = evicted_tokens(free, (hot_tokens if hot_tokens < capacity else capacity) - cached, need)
    work = s_tok * uncached + s_vis * media_uncached
    saturation = fleet_waiting if fleet_waiting > backlog else backlog
    prefill, evict, delay = bias + work, s_tok * evicted, saturation * work
    return queue, prefill, evict, delay, cached, uncached, media_uncached, queue + prefill + evict + delay


class KvCostPolicy(Policy):
    name = "kv_cost"
    config: KvCostConfig

    def __init__(self, deps: PolicyDeps, knobs: PolicyKnobs | None = None) -> None:
        super().__init__(deps, knobs)
        self._by_id_for: Sequence[Worker] | None = None
        self._by_id: dict[str, Worker] = {}
        self._by_id_workers: list[Worker] = []

    def configure(self, knobs: PolicyKnobs) -> None:
        super().configure(knobs)
        self.config = knobs.kv_cost
        self._sample_by_set_above = sample_by_set_above(self.config.shortlist)

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        return self._select(candidates, request, now, _NOT_ANY)

    def select_from(self, candidates: Candidates, request: RoutedRequest, now: float) -> Decision:
        roster = candidates.roster
        if roster is not None and candidates.excluded and len(candidates) > self.config.shortlist_above:
            # a retry: draw from the roster's own list, passing over the tried workers (no copy of the list)
            return self._select(roster.workers, request, now, candidates.excluded)
        return self.select(candidates.workers, request, now)

    def _select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float,
                excluded: Collection[str]) -> Decision:
        """select() over `candidates` less the workers in `excluded` (more than `shortlist_above` are left)."""
        index, estimator = self.deps.prefix_index, self.deps.estimator
        cached_of = self.deps.cached_prefix.match(request, None, now) if request.prefix_hashes else {}
        pool = self._shortlist(candidates, cached_of, excluded)
        snapshots = [w.load.snapshot(now) for w in pool]
        # how saturated the fleet is: the longest queue a candidate reported (reports are 250 ms
        # apart; under a closed loop the one that looks free now is the next to queue)
        fleet_waiting = max(s.reported_waiting for s in snapshots)
        prompt, media, output = request.prompt_tokens, request.media_tokens, request.expected_output_tokens
        expected_kv = request.expected_kv_tokens
        models, hot_of, rng = estimator.models, index.hot_by_worker(), self.deps.rng
        best = pool[0]
        best_terms: _Terms | None = None
        best_bucket, best_usage, best_in_flight = 0, 0.0, 0
        ties = 0
        deepest = 0
        debug = log.isEnabledFor(logging.DEBUG)
        resolution_s = self.config.resolution_s
        terms_of: dict[str, _Terms] = {}
        scores: dict[str, float] = {}
        for worker, snap in zip(pool, snapshots, strict=True):
            wid = worker.worker_id
            model = models.get(wid) or estimator.for_worker(wid)
            terms = _terms(snap, model, prompt, media, output, expected_kv, cached_of.get(wid, 0),
                           hot_of.get(wid, 0), now, fleet_waiting)
            if debug:
                terms_of[wid] = terms
            cost = scores[wid] = terms[7]
            if terms[4] > deepest:
                deepest = terms[4]
            # order: (cost in resolution_s steps, projected KV usage, in flight); ties at random
            bucket = int(cost / resolution_s)
            if best_terms is None or bucket < best_bucket or (bucket == best_bucket and (
                    snap.projected_kv_usage < best_usage
                    or (snap.projected_kv_usage == best_usage and snap.in_flight < best_in_flight))):
                best, best_terms, ties = worker, terms, 1
                best_bucket, best_usage, best_in_flight = bucket, snap.projected_kv_usage, snap.in_flight
            elif bucket == best_bucket and snap.projected_kv_usage == best_usage and snap.in_flight == best_in_flight:
                ties += 1  # reservoir sampling: each tied worker equally likely
                if rng.random() * ties < 1.0:
                    best, best_terms = worker, terms
        assert best_terms is not None
        best_pred = Prediction(*best_terms[:7])
        if deepest == 0:
            reason = "cold"
        elif best_pred.cached >= deepest:
            reason = "prefix_owner"
        else:
            reason = "replica"
        if debug:
            predictions = {wid: Prediction(*t[:7]) for wid, t in terms_of.items()}
            log.debug("model=%s prompt=%d media=%d output=%d -> %s (%s) | %s", request.model, request.prompt_tokens,
                      request.media_tokens, request.expected_output_tokens, best.worker_id, reason,
                      "; ".join(f"{wid}: ttft={p.ttft_s * 1000:.1f}ms (queue {p.queue_s * 1000:.1f} + prefill "
                                f"{p.prefill_s * 1000:.1f}, cached {p.cached}) evict={p.evict_s * 1000:.1f}ms "
                                f"delay={p.delay_s * 1000:.1f}ms"
                                for wid, p in predictions.items()))
        kv_tokens = best_pred.uncached + request.expected_output_tokens
        model = estimator.for_worker(best.worker_id)
        prediction = KvCostPrediction(best_pred.queue_s, best_pred.ttft_s,
                                      model.prefill_s(request.prompt_tokens, request.media_tokens),
                                      best_pred.media_uncached)
        return Decision(best, reason, kv_tokens, scores, prefill_tokens=best_pred.uncached, prediction=prediction,
                        cached_tokens=best_pred.cached if request.prefix_hashes else None)

    def _shortlist(self, candidates: Sequence[Worker], cached_of: dict[str, int],
                   excluded: Collection[str] = ()) -> Sequence[Worker]:
        n = len(candidates)
        if n <= self.config.shortlist_above:
            return candidates
        k = self.config.shortlist
        if self._by_id_for is not candidates:
            # A caller may copy the registry's (cached) list per request: the same workers in the same
            # order (compared by identity, in C) keep the map; only a change of workers rebuilds it.
            if candidates != self._by_id_workers:
                self._by_id = {w.worker_id: w for w in candidates}
                self._by_id_workers = list(candidates)
            self._by_id_for = candidates
        rng = self.deps.rng
        if n > self._sample_by_set_above and getattr(type(rng), "_randbelow", None) is _RANDBELOW:
            # random.sample's own draws for a large population (same workers, same order, same rng
            # state after: its set branch and _randbelow, inlined), without its per-call set-up
            getrandbits = rng.getrandbits
            bits = n.bit_length()
            chosen: set[int] = set()
            pool: dict[int, Worker] = {}
            while len(pool) < k:
                j = getrandbits(bits)
                if j >= n or j in chosen:
                    continue
                chosen.add(j)
                w = candidates[j]
                if excluded and w.worker_id in excluded:
                    continue  # uniform over the others all the same
                pool[id(w)] = w
        else:
            untried = [w for w in candidates if w.worker_id not in excluded] if excluded else candidates
            pool = {id(w): w for w in rng.sample(untried, min(k, len(untried)))}
        by_id = self._by_id
        for wid in cached_of:
            if excluded and wid in excluded:
                continue
            holder = by_id.get(wid)
            if holder is not None:
                pool[id(holder)] = holder
        return list(pool.values())

    def on_dispatch(self, decision: Decision, request: RoutedRequest, now: float) -> None:
        wid = decision.worker.worker_id
        self.deps.cached_prefix.insert(request, wid, now)
        self.deps.estimator.for_worker(wid).observe_dispatch(decision.prefill_tokens, decision.kv_tokens)

    def on_finish(self, decision: Decision, request: RoutedRequest, sent_at: float, first_byte_at: float | None,
                  ended_at: float) -> None:
        # Only a streamed answer's first byte is its first token (vLLM sends a non-streamed one whole).
        prediction = decision.prediction
        if not request.stream or first_byte_at is None or prediction is None:
            return
        model = self.deps.estimator.for_worker(decision.worker.worker_id)
        measured = first_byte_at - sent_at
        # learn the prefill parameters only from requests predicted to have waited little: the queue
        # estimate's error would otherwise be fitted as prefill cost
        if prediction.queue_s <= self.config.learn_max_queue_share * measured:
            model.observe_prefill(decision.prefill_tokens, prediction.uncached_media_tokens,
                                  measured - prediction.queue_s)
        model.observe_turnover(ended_at - first_byte_at)
