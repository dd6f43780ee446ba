"""Decisions without a fleet scan: kv_aware's shortlist picks what its full scan picks, and the load order stays true.

On seeded random fleets (real Registry, AdmissionController, PrefixIndex; a hand-set clock): random
readings, dispatches and finishes, old dispatches that time forgets, prefixes held by a few workers,
tried workers. select_from() (the roster's load order, `shortlist` least loaded + prefix holders) must
pick a worker whose cost key equals the best of select() over every candidate; ties at the minimum
are shared by every tied worker, not just the first few in the order.
"""

from __future__ import annotations

import random
from collections import Counter

import orjson
import pytest

from proxy.config import ProxyConfig
from proxy.errors import ProxyError
from proxy.protocol import WorkerRegistration
from proxy.request import CHAT, parse_request
from proxy.routing.admission import AdmissionController
from proxy.routing.base import PolicyDeps, make_policy
from proxy.routing.candidates import Roster, members_in_order
from proxy.routing.kv_aware import load_cost_of
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing_config import AdmissionConfig, KvAwareConfig
from proxy.workers.loadview import Dispatch, EngineReading
from proxy.workers.registry import Registry, Worker

KV_AWARE = KvAwareConfig()  # the knobs the policies here run with: config.yaml's defaults
load_cost = load_cost_of(KV_AWARE)
DISPATCH_FORGET_AFTER_S = AdmissionConfig().dispatch_forget_after_s


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SYSTEMS = [" ".join(f"s{k}w{j}" for j in range(20 + 25 * k)) for k in range(12)]


def chat(i: int, system: str | None, max_tokens: int = 64):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"question {i} " + "x " * (i % 50)}]
    return parse_request(orjson.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens}), CHAT)


class Fleet:
    """A registry of n workers (some scraped rather than reporting), admission and kv_aware over it."""

    def __init__(self, n: int, seed: int, max_model_len: dict[int, int] | None = None,
                 capacity: int = 100_000) -> None:
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.registry = Registry(clock=self.clock)
        self.deps = PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(seed))
        self.admission = AdmissionController(self.registry, ProxyConfig(), self.deps.estimator)
        self.policy = make_policy("kv_aware", self.deps)
        self.dispatches: list[tuple[Worker, Dispatch]] = []
        for i in range(n):
            self.registry.register(WorkerRegistration(
                worker_id=f"w{i}", url=f"http://w{i}", models=["m"], engine="sim", kv_capacity_tokens=capacity,
                max_model_len=(max_model_len or {}).get(i % 4), reports=False))

    def workers(self) -> list[Worker]:
        return self.registry.workers()

    def churn(self, events: int) -> None:
        """Random readings, dispatches, finishes and prefix inserts; time moves on (old dispatches expire)."""
        rng, clock = self.rng, self.clock
        workers = self.workers()
        for _ in range(events):
            worker = rng.choice(workers)
            kind = rng.random()
            if kind < 0.25:
                # coarse values, so that equal costs (ties) happen
                reading = EngineReading(rng.choice([0.0, 0.25, 0.5, 0.75]), rng.randrange(8), rng.choice([0, 0, 0, 2]))
                self.registry.record_scrape(worker, reading)
            elif kind < 0.6:
                self.dispatches.append((worker, worker.load.start_request(rng.choice([0, 500, 2000]), clock.now)))
                if rng.random() < 0.3:
                    seen = chat(0, rng.choice(SYSTEMS))
                    self.deps.prefix_index.insert(seen.prefix_hashes, worker.worker_id, clock.now, seen.prefix_tokens)
            elif kind < 0.85 and self.dispatches:
                w, d = self.dispatches.pop(rng.randrange(len(self.dispatches)))
                w.load.finish_request(d)
            else:
                clock.now += rng.choice([0.01, 0.3, DISPATCH_FORGET_AFTER_S / 2])

    def candidates(self, request, tried=()):
        return self.admission._fitting("m", request, set(tried))


def full_scan_best(fleet: Fleet, candidates, request) -> tuple[tuple[float, int], dict[str, float]]:
    """The full scan's minimum cost key over every candidate, and every candidate's cost."""
    decision = fleet.policy.select(list(candidates.workers), request, fleet.clock.now)
    by_id = {w.worker_id: w for w in candidates.workers}
    scores = decision.scores or {}
    best = min((round(cost, 9), by_id[wid].load.in_flight) for wid, cost in scores.items())
    return best, scores


@pytest.mark.parametrize(("seed", "size", "capacity"), [(s, None, 100_000) for s in range(6)]
                         + [(6, 5, 100_000), (7, 12, 100_000)] + [(s, 10, 4_000) for s in range(8, 12)])
def test_the_shortlist_picks_a_worker_as_cheap_as_the_full_scans_best(seed, size, capacity):
    """(With 4,000 tokens of KV a worker's hot prefixes fill its free blocks: most decisions weigh evictions.)"""
    rng = random.Random(seed)
    fleet = Fleet(size or rng.randint(50, 200), seed, capacity=capacity)
    checked = evicting = left = 0
    for round_ in range(40):
        fleet.churn(rng.randint(5, 80))
        for i in range(5):
            request = chat(round_ * 10 + i, rng.choice(SYSTEMS) if i % 2 else None)  # half without a prefix
            tried = {f"w{rng.randrange(len(fleet.workers()))}" for _ in range(rng.choice([0, 0, 1, 3]))}
            candidates = fleet.candidates(request, tried)
            assert candidates.roster is not None and len(candidates) == len(fleet.workers()) - len(tried)
            fast = fleet.policy.select_from(candidates, request, fleet.clock.now)
            best, scores = full_scan_best(fleet, candidates, request)
            assert fast.worker.worker_id not in tried
            assert (round(scores[fast.worker.worker_id], 9), fast.worker.load.in_flight) == best
            # a pick away from a candidate that caches more than half the prompt says so
            cached = fleet.deps.cached_prefix.match(request, {w.worker_id for w in candidates.workers},
                                                    fleet.clock.now)
            half = request.prompt_tokens / 2
            away = max(cached.values(), default=0) > half >= cached.get(fast.worker.worker_id, 0)
            assert fast.reason == ("left_holder" if away else "lowest_cost")
            left += away
            # beyond the shortlist and the holders, it scores only workers whose load key is below the best cost
            keys = {w.worker_id: load_cost(w.load) for w in candidates.workers}
            below = sum(1 for wid, key in keys.items() if round(key, 9) < best[0])
            holders = len(fleet.deps.prefix_index.match(request.prefix_hashes, None, fleet.clock.now))
            assert len(fast.scores or {}) <= KV_AWARE.shortlist + holders + below
            evicting += sum(1 for wid, cost in scores.items() if round(cost, 9) > round(keys[wid], 9)
                            and not fleet.deps.prefix_index.match(request.prefix_hashes, {wid}, fleet.clock.now))
            checked += 1
    assert checked == 200
    assert (evicting > 100) == (capacity < 10_000)  # the eviction term was in play where caches are small


def test_a_tie_at_the_minimum_is_shared_by_every_tied_worker_not_only_the_first_in_the_order():
    fleet = Fleet(120, 7)
    for worker in fleet.workers():  # an idle fleet: every worker costs the same
        fleet.registry.record_scrape(worker, EngineReading(0.0, 0, 0))
    busy = fleet.workers()[:20]
    for worker in busy:
        fleet.registry.record_scrape(worker, EngineReading(0.5, 4, 0))
    request = chat(1, None)
    candidates = fleet.candidates(request, tried={"w30", "w31"})
    picks = Counter(fleet.policy.select_from(candidates, request, fleet.clock.now).worker.worker_id
                    for _ in range(3000))
    idle = {w.worker_id for w in fleet.workers()[20:]} - {"w30", "w31"}
    assert set(picks) == idle  # every tied worker gets some, no busy or tried one any
    assert max(picks.values()) < 3 * 3000 / len(idle)


def test_an_idle_worker_whose_cache_is_full_of_reused_prefixes_is_not_where_a_long_prompt_goes():
    """Equal loads; ten workers keep prefixes routed to them twice, which a 3,000-token prompt would push out of
    their 4,000 tokens of KV: the prompt goes to any of the others, shared evenly, as the full scan would."""
    fleet = Fleet(120, 3, capacity=4_000)
    for worker in fleet.workers():
        fleet.registry.record_scrape(worker, EngineReading(0.0, 0, 0))
    keeping = [f"w{i}" for i in range(40, 50)]
    for wid in keeping:
        for system in SYSTEMS[8:10]:
            seen = chat(0, system)
            for _ in range(2):
                fleet.deps.prefix_index.insert(seen.prefix_hashes, wid, fleet.clock.now, seen.prefix_tokens)
    assert all(fleet.deps.prefix_index.hot_tokens(wid) > 1_000 for wid in keeping)
    long_prompt = parse_request(orjson.dumps({"model": "m", "max_tokens": 64, "messages": [
        {"role": "user", "content": " ".join(f"word{j}" for j in range(600))}]}), CHAT)
    assert 2_500 < long_prompt.prompt_tokens < 3_800
    candidates = fleet.candidates(long_prompt)
    picks = Counter(fleet.policy.select_from(candidates, long_prompt, fleet.clock.now).worker.worker_id
                    for _ in range(3000))
    assert not set(picks) & set(keeping)
    assert set(picks) == {w.worker_id for w in fleet.workers()} - set(keeping)
    assert max(picks.values()) < 3 * 3000 / 110
    assert fleet.policy.select(list(candidates.workers), long_prompt, fleet.clock.now).worker.worker_id not in keeping
    # a short prompt fits beside their prefixes: they are as good as any
    short = chat(2, None)
    picks = Counter(fleet.policy.select_from(fleet.candidates(short), short, fleet.clock.now).worker.worker_id
                    for _ in range(3000))
    assert set(keeping) <= set(picks)


def assert_order_is_true(fleet: Fleet, roster: Roster) -> None:
    now = fleet.clock.now
    roster.refresh(now)
    entries = list(roster.order(load_cost))  # (a copy: computing the views below may not move anything)
    admitting = roster.admitting
    assert entries == sorted(entries)
    fresh = {w.worker_id: (round(w.load.projected_kv_usage(now) + KV_AWARE.queue_weight * w.load.queue_depth(now)
                                 + KV_AWARE.inflight_weight * w.load.in_flight
                                 + KV_AWARE.backlog_weight * w.load.prefill_backlog / w.load.capacity_tokens, 9),
                           w.load.in_flight) for w in roster.workers}
    assert [e[:2] for e in entries] == [fresh[w.worker_id] for w in members_in_order(entries)]
    assert [w.worker_id for w in members_in_order(entries)] != [] and len(entries) == len(roster.workers)
    assert {w.worker_id for w in members_in_order(entries)} == {w.worker_id for w in roster.workers}
    assert admitting == sum(1 for w in roster.workers if w.load.engine_backlog(now) == 0)


def test_the_load_order_stays_true_through_reports_dispatches_finishes_time_and_membership():
    fleet = Fleet(80, 3)
    roster = fleet.candidates(chat(0, None)).roster
    assert roster is not None
    roster.order(load_cost)
    for step in range(60):
        fleet.churn(25)
        if step % 10 == 3:  # a worker leaves, another comes, one registers again (same load, new object)
            fleet.registry.remove(f"w{step}")
            fleet.registry.register(WorkerRegistration(worker_id=f"new{step}", url=f"http://new{step}",
                                                       models=["m"], engine="sim", reports=False))
            again = fleet.registry.get(f"w{step + 1}")
            assert again is not None
            fleet.registry.register(again.registration)
        if step % 10 == 6:  # a drained worker stops being a candidate
            fleet.registry.drain(f"w{step}")
        fleet.candidates(chat(step, None))  # the roster follows the registry's candidates
        assert_order_is_true(fleet, roster)
    ids = {w.worker_id for w in roster.workers}
    assert "new3" in ids and "w3" not in ids and "w6" not in ids


def test_forgotten_dispatches_reorder_workers_no_event_touched():
    fleet = Fleet(40, 5)
    for worker in fleet.workers():
        fleet.registry.record_scrape(worker, EngineReading(0.2, 2, 0))
    roster = fleet.candidates(chat(0, None)).roster
    assert roster is not None
    roster.order(load_cost)
    loaded = fleet.registry.get("w7")
    assert loaded is not None
    for _ in range(10):
        loaded.load.start_request(20_000, fleet.clock.now)
    entries = roster.order(load_cost)
    assert entries[-1][3].worker is loaded and entries[-1][0] > entries[0][0]
    fleet.clock.now += DISPATCH_FORGET_AFTER_S + 0.1  # nothing happens to w7: time alone forgets those
    assert_order_is_true(fleet, roster)
    entries = roster.order(load_cost)
    # its KV estimate is gone; its 10 requests still in flight keep it last
    assert entries[-1][3].worker is loaded and entries[0][0] == 0.2
    assert entries[-1][0] == round(0.2 + 10 * KV_AWARE.inflight_weight, 9)


def test_a_request_longer_than_some_workers_context_goes_only_to_the_others_and_400_past_all():
    fleet = Fleet(100, 9, max_model_len={0: 2048, 1: 8192, 2: 32768})  # a quarter has no stated limit
    short, long_ = chat(1, None), chat(2, None, max_tokens=6000)
    long_.exact_tokens = True  # as its model's tokenizer counts it: only an exact count rules a worker out
    assert len(fleet.candidates(short)) == 100
    fitting = fleet.candidates(long_)
    assert len(fitting) == 75 and all(w.max_model_len != 2048 for w in fitting.workers)
    for _ in range(50):
        assert fleet.policy.select_from(fitting, long_, fleet.clock.now).worker.max_model_len != 2048
    huge = chat(3, None, max_tokens=40_000)
    huge.exact_tokens = True
    assert {w.max_model_len for w in fleet.candidates(huge).workers} == {None}
    bounded = Fleet(30, 2, max_model_len={0: 2048, 1: 8192, 2: 32768, 3: 4096})
    with pytest.raises(ProxyError) as refused:
        bounded.candidates(huge)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"


def test_the_load_order_stays_true_through_dispatcher_begin_end_and_reports_with_workers_going_stale():
    from proxy.config import FleetConfig
    from proxy.protocol import STALE_AFTER_S, LoadReport
    from proxy.routing.live import LiveConfig
    from proxy.routing.policy_set import PolicySet
    from proxy.routing.service import RoutingService

    rng, clock = random.Random(11), Clock()
    registry = Registry(clock=clock)
    config = FleetConfig()
    deps = PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(11))
    dispatcher = RoutingService(LiveConfig(config, PolicySet(config, "kv_aware", deps)), registry)
    policy = dispatcher.policy_for("m")
    ids = [f"r{i}" for i in range(60)]
    for wid in ids:
        registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}", models=["m"], engine="sim",
                                             kv_capacity_tokens=100_000))
    seq = iter(range(1, 10**9))
    silent = set(rng.sample(ids, 10))  # these stop reporting: they go stale, leave the ready set

    def report(wid: str) -> None:
        registry.record_report(wid, LoadReport(
            worker_id=wid, url=f"http://{wid}", models=["m"], engine="sim", kv_cache_usage=rng.choice([0.1, 0.4, 0.7]),
            kv_capacity_tokens=100_000, num_running=rng.randrange(8), num_waiting=rng.choice([0, 0, 3]),
            seq=next(seq)))

    for wid in ids:
        report(wid)
    tickets = []
    for step in range(400):
        clock.now += 0.02
        for k in range(3):  # round robin: each worker every 0.4 s, the silent ones only until 1003
            wid = ids[(3 * step + k) % len(ids)]
            if wid not in silent or clock.now < 1003.0:
                report(wid)
        coro = dispatcher.pick(policy, chat(step, rng.choice(SYSTEMS)), "m", set(), True)
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        decision = done.value.value
        if decision is not None:
            tickets.append(dispatcher.begin(decision, policy, chat(step, None)))
        if len(tickets) > 40:
            dispatcher.end(tickets.pop(rng.randrange(len(tickets))), None)
        if step % 20 == 0:
            roster = dispatcher.admission._fitting("m", chat(step, None), set()).roster
            assert roster is not None
            roster.order(load_cost)
            assert_order_is_true(_FleetView(clock), roster)  # type: ignore[arg-type]
    ready = {w.worker_id for w in dispatcher.admission._fitting("m", chat(0, None), set()).workers}
    assert clock.now > 1003.0 + STALE_AFTER_S and ready == set(ids) - silent


class _FleetView:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock


def test_kv_cost_retries_draw_from_the_roster_and_never_pick_or_score_a_tried_worker():
    fleet = Fleet(120, 13)
    kv_cost = make_policy("kv_cost", fleet.deps)
    rng = random.Random(13)
    fleet.churn(300)
    picked = Counter()
    for i in range(300):
        request = chat(i, rng.choice(SYSTEMS) if i % 2 else None)
        tried = {f"w{rng.randrange(120)}" for _ in range(rng.randint(1, 4))}
        candidates = fleet.candidates(request, tried)
        decision = kv_cost.select_from(candidates, request, fleet.clock.now)
        assert decision.worker.worker_id not in tried and not tried & set(decision.scores or {})
        assert len(decision.scores or {}) >= 8
        picked[decision.worker.worker_id] += 1
    assert len(picked) > 30  # a random shortlist per decision: spread over the fleet, not a fixed few
