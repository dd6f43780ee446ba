"""kv_aware (default): route on what the engines report, corrected for what was just sent.

For each candidate worker w (all below the KV high-water mark, see dispatch.py):

    cost(w) = projected_kv_usage(w)                      # loadview: reported + pending / capacity
            + QUEUE_WEIGHT  * queue_depth(w)             # reported num_waiting + sent since report
            + INFLIGHT_WEIGHT * in_flight(w)             # requests sent there and not finished (Decode batch)
            - PREFIX_WEIGHT * min(1, cached_tokens(w) / PREFIX_SATURATION_TOKENS) * share(w)
            + BACKLOG_WEIGHT * (prefill_backlog(w) - credit(w) * cached_tokens(w)) / capacity(w)
    share(w)  = cached_tokens(w) / prompt_tokens                 # of this request's prompt
    credit(w) = CACHED_PREFILL_CREDIT + CREDIT_PER_CACHE_SHARE * cached_tokens(w) / capacity(w)

and the request goes to the lowest cost (ties: fewest in flight, then random). cached_tokens is
the estimated prompt tokens (text and images) the prefix index says w has seen most recently.
Defaults: QUEUE_WEIGHT 0.02 (50 queued requests weigh like a full cache), PREFIX_WEIGHT 1.0
(1024 reused prompt tokens are worth a whole cache of KV usage), PREFIX_SATURATION_TOKENS 1024.
So a shared system prompt or a reused image keeps its worker until that worker is much fuller
than another or has more prompts queued to prefill (Prefill backlog, below), and the expected KV a
request adds on w excludes the part w already caches. PREFIX_WEIGHT was 0.3 at first: bench/quality.py showed a
256-token image then worth only 0.075, so image questions scattered, every worker prefilled the
same images again and at 95% load 224 of 1047 VQA requests were refused; at 1.0 none were and
goodput went from 35% to 98%, with chat and the two-model mix unchanged
(bench/results/2026-11-29-quality.md, rows kv_aware@prefix_weight=1.0).
share(w) weighs the prefix by the part of the prompt it saves (as sglang-router's cache_aware
only follows a match covering enough of the request): a 500-token shared head on an 8000-token
prompt saves 6% of its prefill, so that prompt goes where the load is lowest instead of piling
onto the head's holder; a system prompt, image or session history that is most of the prompt
keeps its whole weight. Side by side in `kvroute bench quality` (lengths family, closed loop, 3
repeats; bench/results/2026-12-01-quality-prefix-share.md) it evened requests per worker and cut
preemptions from 7 to 4 per 1000 requests and TTFT p50 from 126 to 117 ms, with TTFT p99 and
makespan equal within the spread; kv_pressure and zipf_hot were unchanged in a 2-repeat check
(`kv_aware@prefix_by_share=False` runs the old scoring).

Prefill backlog, on by default since 2026-12-01: the prefix term above is in units of KV usage, and it
made a prefix stick to its first holder however long that holder's queue of prompts grew (50 queued requests
weigh like one reused 1024-token prefix). In time the trade is simple: a request's first token on w comes
after the prompts already waiting there to be prefilled and its own uncached part, so

    cost(w) += BACKLOG_WEIGHT * (prefill_backlog(w) - credit(w) * cached_tokens(w)) / capacity(w)

prefill_backlog(w) is the prompt tokens in flight on w that have produced no output yet (loadview.py; exact,
from the proxy's own relay, no report lag; a non-streamed request counts until it ends). The second part
is the prefill a cached prefix saves there, in the same units; it is written as a credit to the holders
(not as + uncached to everyone) so that a worker holding nothing costs its roster key (see Scale). So a
hot prefix gets a replica as soon as its holder has more prompt work queued than a copy would cost, and
not before. The weights were measured, not derived (`kvroute bench quality`, closed loop, 32 clients per
worker; `kv_aware@backlog_weight=..+cached_credit=..` runs other values; the runs below named the credit
`own_prefill`, an equivalent form for workers of equal capacity):
- BACKLOG_WEIGHT 0 (the old default) -> 10: TTFT p99 after the first wave in the bursts family (4 shared
  1500-token system prompts that fit every cache) 330 -> 121 ms (round robin reached 109), in lengths
  628 -> 500 ms, TTFT p99 in two_models 373 -> 180 ms; sessions and zipf_hot equal or better (quick
  2-repeat runs). At 1, 3 it changed nothing.
- CACHED_PREFILL_CREDIT 0 with BACKLOG_WEIGHT 10: kv_pressure (3000-6000-token prefixes, twice one
  worker's cache) thrashed: a holder's backlog blip moved a big prefix, the copy's own prefill made the
  next worker look busy, and so on (makespan 12 -> 22 s, 70 preemptions per 1000 requests, hit rate
  95 -> 81%). 1.0 stopped that but counted the cached part twice (the prefix term counts it too): zipf_hot
  makespan +9%. 0.5 kept kv_pressure at the old default's makespan and hit rate.
- Side by side with the old default and sglang-router, 3 repeats, six families
  (bench/results/2026-12-01-quality-closed-backlog.md): TTFT p99 after the first wave bursts 229 -> 122 ms
  (sglang-router 172), lengths 709 -> 485 ms (TTFT p50 125 -> 80); the other four families within the
  spread. Open loop (bench/results/2026-12-01-quality-matrix-open.md) its weak cell is kv_pressure at 95%
  load: 79 (0-126) preemptions per 1000 requests, sglang-router 20 (2-33), goodput 96% vs 99%. A same-run
  A/B of that cell (bench/results/2026-12-01-quality-kv_pressure-95-backlog-ab.md, 5 repeats) puts it on
  this term: 61 (9-177) preemptions and TTFT p99 1067 ms with it, 5 (0-27) and 762 ms at backlog_weight=0.
  Under that load a long prefix still moves now and then and its copies crowd the caches.
- credit(w) grows with the prefix's share of the cache (CREDIT_PER_CACHE_SHARE 5, since 2026-12-01
  evening): a copy of a prefix that fills a tenth to a fifth of a cache (kv_pressure's 3000-6000-token
  prompts and 3072-token images, 32768-token caches) takes that much room on the worker it moves to,
  room other prompts' cached prefixes and running requests held: it evicts them (their prefill comes
  back later) or preempts. So its price is the copy's own prefill plus about as much again for what it
  pushes out, where a 500-1500-token system prompt in a 65536-token cache (bursts, lengths) moves almost
  as before (credit 0.5 -> 0.55-0.61). kv_pressure at 95%, same run, 3 repeats
  (bench/results/2026-12-01-quality-kv_pressure-95-credit-ab.md): preemptions per 1000 requests 118
  (82-164) -> 9 (0-27), TTFT p99 1268 -> 680 ms, goodput 95 -> 100%; a second run of the same cell
  (...-credit-ab2.md) 13 (0-23) -> 10 (0-24), 787 -> 720 ms (the cell is bistable: once copies crowd
  the caches it collapses).
  Closed loop bursts, 3 repeats (bench/results/2026-12-01-quality-bursts-credit-ab.md): p99 after the
  first wave 145 (130-169) -> 129 (119-136) ms, makespan equal. A credit growing with the holder's KV
  usage instead (CREDIT_PER_USAGE, off; `kv_aware@credit_per_usage=0.5`) fixed kv_pressure as well but
  counts running requests, not cached prefixes: bursts' after-wave p99 rose (124 -> 156 ms at 1.0).
  The full matrices with this default are in README's Performance section.

Decode batch, on by default since 2026-12-01 (night): the terms above price a request's first token
and left out the rest of its life. On w its output comes one token per engine step, and a step grows with
the batch (per-sequence overhead plus reading every running sequence's KV; backends/sim/cost.py models
vLLM's): a worker running twice the requests of another gives each of its requests a slower decode, and the
request sent there slows every one of them a little more. The prefix terms alone kept a hot prefix on its
holder however large the holder's batch grew (zipf_hot, open loop: one worker served about half of the
requests, 477-546 of 1000; end-to-end p99 35-40% above sglang-router's, which spreads by in-flight count). So

    cost(w) += INFLIGHT_WEIGHT * in_flight(w)

in_flight(w) is exact (the proxy's own count, no report lag) and request-independent, so it joins the
roster key. INFLIGHT_WEIGHT 0.03: a fully held 1024-token prefix (bonus ~1.1) moves only once its holder runs
~35 more requests than another worker, so a hot prefix gets replicas under load and stays put otherwise.
Same-run A/Bs, 3 repeats (`kv_aware@inflight_weight=...`; bench/results/2026-12-01-quality-inflight-ab-*.md):
closed zipf_hot makespan 12.7 -> 11.4 (0.01) -> 10.9 s (0.03), end-to-end p99 4.1 -> 3.3 s, requests per
worker 155-478 -> 231-263, prefix hit rate 86% unchanged; open zipf_hot at 80% end-to-end p99 2.9 -> 2.1 s,
TTFT p50 44 -> 34 ms, TTFT p99 equal within the spread; closed kv_pressure makespan 13.8 -> 13.1 s,
preemptions 8 -> 0 per 1000 requests; lengths, sessions, bursts, two_models within the spread.

Scale: admission hands select_from() a roster (proxy/routing/candidates.py) that keeps its members
sorted by (round(load_cost, 9), in flight) as their loads change; load_cost is cost without the
prefix term, computed with the same arithmetic. For a worker the prefix index does not name, that
key is its cost key, so the cheapest of them is the first untried one in the order: only the
SHORTLIST least loaded of those and every worker the index names for this prompt are scored, and
the minimum is the full scan's minimum
(tests/proxy/test_candidates.py checks it on random fleets). Ties: where the tie at the minimum
reaches past the shortlist, the pick is uniform over every tied candidate (a range of the order),
as the full scan's reservoir sampling makes it. Decision.scores then holds the scored workers only
(the shortlist's as their rounded keys).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Collection, Sequence

from proxy.loadview import WorkerLoad
from proxy.registry import Worker
from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.routing.candidates import Candidates, Entry, Roster

log = logging.getLogger("kvroute.routing.kv_aware")

QUEUE_WEIGHT = 0.02
PREFIX_WEIGHT = 1.0
PREFIX_SATURATION_TOKENS = 1024
# Weigh the prefix term by the share of the prompt the worker holds (the docstring's share(w))
PREFIX_BY_SHARE = True
# Weight of the prefill backlog (prompt tokens in flight there without output yet, / KV capacity), and the
# share of a cached prefix's tokens credited against it: see the docstring's "Prefill backlog"
BACKLOG_WEIGHT = 10.0
CACHED_PREFILL_CREDIT = 0.5
# Off by default (an ablation knob, `credit_per_usage`): the credit grows by this much per unit of the
# holder's projected KV usage, so long prefixes stay put when caches are full (see "Prefill backlog")
CREDIT_PER_USAGE = 0.0
# The credit grows by this much per unit of the cached prefix's share of the worker's KV capacity
# (cached / capacity): a prefix that fills much of a cache stays put (docstring, "Prefill backlog")
CREDIT_PER_CACHE_SHARE = 5.0
# Weight of each request in flight on the worker (its batch and queue; the proxy's own count): see the
# docstring's "Decode batch"
INFLIGHT_WEIGHT = 0.03
# select_from() scores this many of the least loaded candidates plus the prefix holders (module docstring).
SHORTLIST = 8


def load_cost(load: WorkerLoad) -> float:
    """cost() of a worker holding no prefix of the request, as of its load's last event (the roster's key)."""
    usage, queue = load.usage_and_queue()
    return (usage + QUEUE_WEIGHT * queue + INFLIGHT_WEIGHT * load.in_flight
            + BACKLOG_WEIGHT * load.prefill_backlog / load.capacity_tokens)


def prefix_bonus(request: RoutedRequest, cached: int, capacity_tokens: int, usage: float = 0.0) -> float:
    """The prefix terms of cost(): what holding `cached` of the request's prompt tokens is worth on a worker
    (its KV-unit bonus, and the prefill it saves in backlog units; `usage`: the worker's projected KV usage)."""
    if not cached:
        return 0.0
    bonus = PREFIX_WEIGHT * min(1.0, cached / PREFIX_SATURATION_TOKENS)
    if PREFIX_BY_SHARE and request.prompt_tokens > cached:
        bonus *= cached / request.prompt_tokens
    credit = CACHED_PREFILL_CREDIT + CREDIT_PER_USAGE * usage + CREDIT_PER_CACHE_SHARE * cached / capacity_tokens
    return bonus + BACKLOG_WEIGHT * credit * cached / capacity_tokens


def worker_cost(load: WorkerLoad, request: RoutedRequest, cached: int, now: float) -> float:
    """cost(w) of the module docstring for a worker that caches `cached` of the request's prompt tokens."""
    usage = load.projected_kv_usage(now)
    return (usage + QUEUE_WEIGHT * load.queue_depth(now) + INFLIGHT_WEIGHT * load.in_flight
            + BACKLOG_WEIGHT * load.prefill_backlog / load.capacity_tokens
            - prefix_bonus(request, cached, load.capacity_tokens, usage))


def cached_tokens(request: RoutedRequest, depth: int) -> int:
    """Estimated prompt tokens covered by the first `depth` prefix blocks."""
    return request.prefix_tokens[depth - 1] if depth > 0 else 0


class KvAwarePolicy(Policy):
    name = "kv_aware"

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        depths: dict[str, int] = {}
        if request.prefix_hashes and len(candidates) > 1:
            ids = {w.worker_id for w in candidates}
            depths = self.deps.prefix_index.match(request.prefix_hashes, ids, now)
        best: Worker | None = None
        best_key: tuple[float, int] = (float("inf"), 0)
        best_cached = 0
        ties = 0
        scores: dict[str, float] = {}
        for worker in candidates:
            load = worker.load
            cached = cached_tokens(request, depths.get(worker.worker_id, 0))
            cost = worker_cost(load, request, cached, now)
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
                      request.prompt_tokens, self._explain(candidates, scores, depths, request, now),
                      best.worker_id, best_cached)
        prefill = max(0, request.prompt_tokens - best_cached)
        return Decision(best, "lowest_cost", prefill + request.expected_output_tokens, scores, prefill_tokens=prefill)

    def select_from(self, candidates: Candidates, request: RoutedRequest, now: float) -> Decision:
        roster = candidates.roster
        if roster is None:  # a plain list (kv_high_water on, or a retry with only stale workers left)
            return self.select(candidates.workers, request, now)
        roster.refresh(now)
        entries = roster.order(load_cost)
        excluded = candidates.excluded
        scores: dict[str, float] = {}
        # the workers the prefix index names: scored as select() scores them
        depths: dict[str, int] = {}
        holders: list[tuple[Worker, int, tuple[float, int]]] = []  # (worker, cached tokens, cost key)
        if request.prefix_hashes:
            depths = self.deps.prefix_index.match(request.prefix_hashes, None, now)
            for wid, depth in depths.items():
                member = roster.member(wid)
                if member is None or wid in excluded:
                    continue
                load = member.load
                cached = cached_tokens(request, depth)
                cost = worker_cost(load, request, cached, now)
                scores[wid] = cost
                holders.append((member.worker, cached, (round(cost, 9), load.in_flight)))
        # every other candidate costs its order key: the first SHORTLIST of them are the cheapest
        shortlist: list[Entry] = []
        i, size = 0, len(entries)
        while len(shortlist) < SHORTLIST and i < size:
            entry = entries[i]
            i += 1
            wid = entry[3].worker.worker_id
            if wid not in depths and wid not in excluded:
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
        if tied_short == SHORTLIST:
            # the tie at the minimum may reach past the shortlist: pick among all of it, as select() would
            best, best_cached = self._among_tied(roster, entries, best_key, tied_holders, depths, excluded)
        elif tied == 1:
            best, best_cached = tied_holders[0] if tied_holders else (shortlist[0][3].worker, 0)
        else:  # ties: each of the tied workers equally likely
            k = int(self.deps.rng.random() * tied)
            best, best_cached = tied_holders[k] if k < len(tied_holders) else (shortlist[k - len(tied_holders)][3].worker, 0)
        if log.isEnabledFor(logging.DEBUG):
            scored = [w for w, _, _ in holders] + [e[3].worker for e in shortlist]
            log.debug("model=%s prompt_tokens=%d scored %d of %d candidates: %s -> %s (cached %d tokens)",
                      request.model, request.prompt_tokens, len(scored), len(candidates),
                      self._explain(scored, scores, depths, request, now), best.worker_id, best_cached)
        prefill = max(0, request.prompt_tokens - best_cached)
        return Decision(best, "lowest_cost", prefill + request.expected_output_tokens, scores, prefill_tokens=prefill)

    def _among_tied(self, roster: Roster, entries: Sequence[Entry], key: tuple[float, int],
                    tied_holders: Sequence[tuple[Worker, int]], depths: dict[str, int],
                    excluded: Collection[str]) -> tuple[Worker, int]:
        """(worker, cached tokens) uniformly among the candidates whose cost key is `key`: the holders
        given, and the untried non-holders in the order's range of that load key."""
        lo = bisect_left(entries, key)
        hi = bisect_left(entries, (key[0], key[1] + 1))
        outside = 0  # members in [lo, hi) that are not tied candidates there: tried, or holders (scored apart)
        for wid in {*excluded, *depths}:
            member = roster.member(wid)
            if member is not None and member.key is not None and member.key[:2] == key:
                outside += 1
        rng = self.deps.rng
        pick = rng.randrange(len(tied_holders) + (hi - lo) - outside)
        if pick < len(tied_holders):
            return tied_holders[pick]
        while True:  # uniform over the range's candidates: draw until one is (most are)
            worker = entries[lo + rng.randrange(hi - lo)][3].worker
            if worker.worker_id not in excluded and worker.worker_id not in depths:
                return worker, 0

    def on_dispatch(self, decision: Decision, request: RoutedRequest, now: float) -> None:
        if request.prefix_hashes:
            self.deps.prefix_index.insert(request.prefix_hashes, decision.worker.worker_id, now)

    def _explain(self, candidates: Sequence[Worker], scores: dict[str, float], depths: dict[str, int],
                 request: RoutedRequest, now: float) -> str:
        """Each scored candidate's terms, and `ttft~`: the first-token time they predict there, the prompt
        tokens queued to prefill ahead of the request plus its own uncached part at that worker's learnt
        prefill cost (estimator.py; what its reports say, the priors before any)."""
        parts = []
        for w in candidates:
            load = w.load
            cached = cached_tokens(request, depths.get(w.worker_id, 0))
            uncached = max(0, request.prompt_tokens - cached)
            media = request.media_tokens * uncached // request.prompt_tokens if request.media_tokens else 0
            ttft = self.deps.estimator.for_worker(w.worker_id).prefill_s(load.prefill_backlog + uncached, media)
            parts.append(f"{w.worker_id}: cost={scores[w.worker_id]:.4f} ttft~{ttft * 1000:.0f}ms "
                         f"kv={load.projected_kv_usage(now):.3f} queue={load.queue_depth(now)} "
                         f"backlog={load.prefill_backlog} cached={cached}")
        return "; ".join(parts)
