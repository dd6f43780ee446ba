"""Routing policies on hand-built load views: what each one picks, and why."""

from __future__ import annotations

import logging
import random
import re
from collections import Counter

import orjson
import pytest

from proxy.request import CHAT, parse_request
from proxy.routing.base import PolicyDeps, make_policy, policy_names
from proxy.routing.prefix_index import PrefixIndex
from proxy.workers.loadview import EngineReading
from proxy.workers.registry import Worker

NOW = 500.0


def worker(wid: str, usage: float | None = None, waiting: int = 0, capacity: int = 100_000) -> Worker:
    w = Worker(wid, f"http://{wid}", ["m"], capacity_tokens=capacity)
    if usage is not None:
        w.load.record_reading(EngineReading(usage, 0, waiting, capacity), NOW, "report")
    return w


def request(text: str = "hello", system: str | None = None, session: str | None = None, max_tokens: int = 100):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    body = orjson.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens})
    return parse_request(body, CHAT, session_header=session)


def deps(seed: int = 1) -> PolicyDeps:
    return PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(seed))


def dispatch(policy, workers, req, now=NOW):
    decision = policy.select(workers, req, now)
    decision.worker.load.start_request(decision.kv_tokens, now)
    policy.on_dispatch(decision, req, now)
    return decision


def prefix_held_by_one_of_two(system: str, usage: float = 0.2, capacity: int = 100_000):
    """kv_aware over two equal workers after a first request with `system`: (policy, a, b, holder, other)."""
    policy = make_policy("kv_aware", deps())
    a, b = worker("a", usage, capacity=capacity), worker("b", usage, capacity=capacity)
    holder = dispatch(policy, [a, b], request("q0", system=system)).worker
    return policy, a, b, holder, (b if holder is a else a)


def test_every_named_policy_exists_and_unknown_names_are_refused():
    for name in policy_names():
        assert make_policy(name, deps()).name == name
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope", deps())


def test_kv_aware_prefers_the_worker_with_kv_room():
    policy = make_policy("kv_aware", deps())
    full, roomy = worker("full", 0.8), worker("roomy", 0.3)
    assert policy.select([full, roomy], request(), NOW).worker is roomy


def test_kv_aware_spreads_a_burst_by_projected_usage():
    policy = make_policy("kv_aware", deps())
    low, high = worker("low", 0.10, capacity=20_000), worker("high", 0.30, capacity=20_000)
    picks = Counter(dispatch(policy, [low, high], request(f"question {i}", max_tokens=200)).worker.worker_id
                    for i in range(100))
    # 'low' first absorbs its 0.2 head start (each request adds ~0.01 KV + 0.02 queue + 0.03 in flight), then
    # they alternate
    assert picks["low"] > picks["high"] >= 35
    costs = [w.load.projected_kv_usage(NOW) + 0.02 * w.load.queue_depth(NOW) + 0.03 * w.load.in_flight
             for w in (low, high)]
    assert abs(costs[0] - costs[1]) < 0.05


def test_kv_aware_keeps_a_long_shared_prompt_on_one_worker_while_balanced():
    policy = make_policy("kv_aware", deps())
    workers = [worker("a", 0.2), worker("b", 0.2), worker("c", 0.2)]
    system = "You are a meticulous assistant that answers in French. " * 60
    picks = {dispatch(policy, workers, request(f"q{i}", system=system)).worker.worker_id for i in range(10)}
    assert len(picks) == 1


def test_kv_aware_lets_go_of_the_prefix_when_its_worker_is_much_busier():
    policy = make_policy("kv_aware", deps())
    a, b = worker("a", 0.2), worker("b", 0.2)
    system = "Shared instructions. " * 200
    first = dispatch(policy, [a, b], request("q0", system=system)).worker
    other = b if first is a else a
    # A fully cached 1000-token prefix is worth a whole cache of KV usage (PREFIX_WEIGHT 1.0), so
    # fuller KV alone keeps it until the high-water mark; KV plus a long queue outweighs it.
    first.load.record_reading(EngineReading(0.6, 10, 0, 100_000), NOW + 1, "report")
    other.load.record_reading(EngineReading(0.2, 0, 0, 100_000), NOW + 1, "report")
    assert policy.select([a, b], request("q1", system=system), NOW + 1).worker is first
    first.load.record_reading(EngineReading(0.6, 10, 40, 100_000), NOW + 2, "report")
    assert policy.select([a, b], request("q2", system=system), NOW + 2).worker is other


def test_kv_aware_weighs_a_shared_head_by_the_share_of_the_prompt_it_saves():
    system = "Shared instructions. " * 200  # ~1000 tokens held by the worker that served it first
    policy, a, b, holder, other = prefix_held_by_one_of_two(system)
    holder.load.record_reading(EngineReading(0.45, 10, 0, 100_000), NOW + 1, "report")
    other.load.record_reading(EngineReading(0.2, 10, 0, 100_000), NOW + 1, "report")
    # A short question after the head: the head is most of its prompt, so it stays with the holder
    # although the holder is fuller.
    assert policy.select([a, b], request("q1", system=system), NOW + 1).worker is holder
    # A long document after the same head: the head saves a small part of its prefill, so it goes
    # where the load is lower instead of piling onto the holder.
    document = " ".join(f"paragraph{i} of a long report" for i in range(1500))
    assert policy.select([a, b], request(document, system=system), NOW + 1).worker is other


def test_kv_aware_gives_a_hot_prefix_a_replica_while_its_holder_has_prompts_queued_to_prefill():
    system = "Shared instructions. " * 200  # ~500 tokens: a system prompt every cache can hold
    policy, a, b, holder, other = prefix_held_by_one_of_two(system)
    assert policy.select([a, b], request("q1", system=system), NOW).worker is holder
    # a burst of new prompts lands on the holder: 4 x 4500 tokens it has not prefilled yet
    queued = [holder.load.start_request(4600, NOW, prefill_tokens=4500) for _ in range(4)]
    # waiting behind 18000 tokens of prefill costs more than prefilling the 500-token prefix elsewhere
    assert policy.select([a, b], request("q2", system=system), NOW).worker is other
    # once they produced their first tokens the holder is the faster place again
    for d in queued:
        holder.load.first_output(d)
    assert policy.select([a, b], request("q3", system=system), NOW).worker is holder


def test_kv_aware_does_not_move_a_long_prefix_for_a_backlog_its_copy_would_cost_as_much():
    system = "Long shared instructions for every request of this tenant. " * 400  # ~4000 tokens
    policy, a, b, holder, other = prefix_held_by_one_of_two(system, 0.3, 32_768)
    # the holder prefills one cold prompt about as long as the prefix: a copy elsewhere would queue as long
    holder.load.start_request(4200, NOW, prefill_tokens=4000)
    assert policy.select([a, b], request("q1", system=system), NOW).worker is holder
    # a backlog of several such prompts is worth a copy
    for _ in range(3):
        holder.load.start_request(4200, NOW, prefill_tokens=4000)
    assert policy.select([a, b], request("q2", system=system), NOW).worker is other


def test_kv_aware_keeps_a_prefix_that_fills_a_large_share_of_the_cache_where_it_is():
    system = "Long shared instructions for every request of this tenant. " * 800  # ~8000 tokens
    policy, a, b, holder, other = prefix_held_by_one_of_two(system, 0.3, 32_768)
    # two cold 5000-token prompts queued on the holder: a copy of a quarter of a cache would push out as much
    # of the other worker's cache as the queue costs, so the prefix stays (a 500-token one moves: the test above)
    for _ in range(2):
        holder.load.start_request(5200, NOW, prefill_tokens=5000)
    assert policy.select([a, b], request("q1", system=system), NOW).worker is holder
    # a backlog several times the copy's cost is still worth one
    for _ in range(4):
        holder.load.start_request(5200, NOW, prefill_tokens=5000)
    assert policy.select([a, b], request("q2", system=system), NOW).worker is other


def test_kv_aware_spreads_a_hot_prefix_once_its_holder_runs_many_more_requests():
    system = "Shared instructions. " * 200  # a system prompt most of every request's prompt
    policy, a, b, holder, other = prefix_held_by_one_of_two(system, 0.2, 65_536)

    def decoding(n: int) -> None:  # n more requests past their prefill on the holder, then both workers report
        for _ in range(n):
            holder.load.first_output(holder.load.start_request(300, NOW, prefill_tokens=200))
        holder.load.record_reading(EngineReading(0.3, holder.load.in_flight, 0, 65_536), NOW + 1, "report")
        other.load.record_reading(EngineReading(0.25, 0, 0, 65_536), NOW + 1, "report")

    # a batch of 10 on the holder: the cached prefix is worth more than the idle worker
    decoding(9)
    assert policy.select([a, b], request("q1", system=system), NOW + 1).worker is holder
    # a batch of 50: every step there is slower for each of them, so a replica is worth its prefill
    decoding(40)
    assert policy.select([a, b], request("q2", system=system), NOW + 1).worker is other


def test_kv_aware_debug_log_shows_each_candidates_predicted_first_token_time(caplog):
    policy = make_policy("kv_aware", deps())
    idle, busy = worker("idle", 0.2), worker("busy", 0.2)
    for _ in range(4):
        busy.load.start_request(2100, NOW, prefill_tokens=2000)  # 8000 prompt tokens queued to prefill there
    with caplog.at_level(logging.DEBUG, logger="kvroute.routing.kv_aware"):
        assert policy.select([idle, busy], request("hello"), NOW).worker is idle
    line = caplog.records[-1].getMessage()
    predicted = {wid: float(ms) for wid, ms in re.findall(r"(\w+): cost=\S+ ttft~(\d+)ms", line)}
    # at the prior prefill rate (10k tokens/s) 8000 queued tokens are ~0.8 s ahead of the request
    assert predicted["idle"] < 50 and 700 < predicted["busy"] < 900
    assert "backlog=8000" in line


def test_kv_aware_counts_queued_requests():
    policy = make_policy("kv_aware", deps())
    queued, idle = worker("queued", 0.3, waiting=20), worker("idle", 0.5)
    assert policy.select([queued, idle], request(), NOW).worker is idle


def test_prefix_policy_follows_the_prefix_and_yields_to_imbalance():
    policy = make_policy("prefix", deps())
    a, b = worker("a", 0.1), worker("b", 0.1)
    system = "Long shared context. " * 100
    first = dispatch(policy, [a, b], request("q", system=system)).worker
    assert policy.select([a, b], request("other q", system=system), NOW).worker is first
    for _ in range(40):
        first.load.start_request(10, NOW)
    assert policy.select([a, b], request("other q", system=system), NOW).worker is not first


def test_prefix_policy_spreads_unrelated_prompts_between_reports():
    policy = make_policy("prefix", deps())
    a, b = worker("a", 0.10), worker("b", 0.12)  # a reported a little less KV in use
    chosen = [dispatch(policy, [a, b], request(f"unrelated question number {i}")).worker for i in range(10)]
    assert chosen.count(a) == 5 and chosen.count(b) == 5  # by in-flight, not all onto the lower report


def test_session_policy_is_sticky_and_moves_only_the_removed_workers_sessions():
    policy = make_policy("session", deps())
    workers = [worker(f"w{i}") for i in range(4)]
    before = {s: policy.select(workers, request(session=s), NOW).worker for s in map(str, range(200))}
    again = {s: policy.select(workers, request(session=s), NOW).worker for s in before}
    assert before == again
    assert len({w.worker_id for w in before.values()}) == 4
    survivors = workers[1:]
    after = {s: policy.select(survivors, request(session=s), NOW).worker for s in before}
    moved = [s for s in before if before[s] is not after[s]]
    assert all(before[s] is workers[0] for s in moved)


def test_round_robin_least_requests_and_lmdeploy_latency():
    workers = [worker("a"), worker("b"), worker("c")]
    rr = make_policy("round_robin", deps())
    assert [rr.select(workers, request(), NOW).worker.worker_id for _ in range(6)] == list("abcabc")
    workers[0].load.start_request(1, NOW)
    workers[1].load.start_request(1, NOW)
    assert make_policy("least_requests", deps()).select(workers, request(), NOW).worker.worker_id == "c"
    workers[2].labels["speed"] = "0.1"  # LMDeploy: unfinished / speed -> 0 / 0.1 still wins
    assert make_policy("lmdeploy_min_expected_latency", deps()).select(workers, request(), NOW).worker.worker_id == "c"


def test_power_of_two_never_picks_the_busier_of_two():
    busy, idle = worker("busy"), worker("idle")
    for _ in range(5):
        busy.load.start_request(1, NOW)
    policy = make_policy("power_of_two", deps())
    assert {policy.select([busy, idle], request(), NOW).worker.worker_id for _ in range(20)} == {"idle"}


def test_prefix_index_is_bounded_and_forgets_the_least_recently_used():
    index = PrefixIndex(max_blocks=10)
    index.insert([1, 2, 3, 4, 5, 6], "a", NOW)
    index.insert([7, 8, 9, 10, 11, 12], "b", NOW)
    assert len(index) == 10
    assert index.match([7, 8, 9], {"a", "b"}, NOW) == {"b": 3}
    # the tails of the older prompt went first; its head is still there
    assert index.match([1, 2, 3, 4, 5, 6], {"a"}, NOW) == {"a": 4}


def test_prefix_index_ignores_entries_older_than_its_ttl():
    index = PrefixIndex(ttl_s=10)
    index.insert([1, 2], "a", NOW)
    assert index.match([1, 2], {"a"}, NOW + 5) == {"a": 2}
    assert index.match([1, 2], {"a"}, NOW + 11) == {}


def test_a_model_can_have_its_own_policy():
    from proxy.config import FleetConfig
    from proxy.routing.policy_set import PolicySet

    config = FleetConfig.model_validate({"models": [
        {"name": "chat", "engine": "sim", "policy": "session"}, {"name": "other", "engine": "sim"}]})
    policies = PolicySet(config, "kv_aware", deps())
    assert policies.for_model("chat").name == "session"
    assert policies.for_model("other").name == "kv_aware"
    assert policies.for_model("unlisted").name == "kv_aware"
    bad = FleetConfig.model_validate({"models": [{"name": "x", "engine": "sim", "policy": "fastest"}]})
    with pytest.raises(ValueError, match="fastest"):
        PolicySet(bad, "kv_aware", deps())


def test_kv_aware_with_a_bonus_per_step_keeps_a_prefix_longer_than_an_engine_step_home_under_a_longer_queue():
    from proxy.routing_config import KvAwareConfig, PolicyKnobs

    system = "Shared instructions. " * 2800  # ~7.4k tokens, nearly all of each prompt below

    def pick(per_step: float, step_tokens: int | None) -> str:
        knobs = PolicyKnobs(kv_aware=KvAwareConfig(prefix_bonus_per_step=per_step))
        policy = make_policy("kv_aware", deps(), knobs)
        a, b = worker("a", capacity=400_000), worker("b", capacity=400_000)
        for w in (a, b):
            w.load.step_tokens = step_tokens  # what the engine's worker reports (None: 8192 assumed)
        holder = dispatch(policy, [a, b], request("q0", system=system)).worker
        for _ in range(2):  # 50k prompt tokens waiting to prefill there
            holder.load.start_request(25_000, NOW, prefill_tokens=25_000)
        decision = policy.select([a, b], request("q1", system=system), NOW)
        where = "holder" if decision.worker is holder else "other"
        # the decision says when load outweighed the prefix (kvroute:routing_decisions_total counts the reason)
        assert decision.reason == {"holder": "lowest_cost", "other": "left_holder"}[where]
        return where

    assert pick(0.0, 2048) == "other"  # capped at prefix_weight: the queue outweighs it, and the prefix is copied
    assert pick(1.0, 2048) == "holder"  # a copy takes 3.6 steps of 2048 tokens: worth 3.6 units, it stays home
    assert pick(KvAwareConfig().prefix_bonus_per_step, 2048) == "holder"  # the default counts the steps
    assert pick(1.0, None) == pick(1.0, 32768) == "other"  # within one step of these engines: capped as before
    # only the steps beyond the first count: a prefix within one step stays capped whatever the per-step bonus
    assert pick(3.0, None) == "other"
    assert pick(3.0, 4096) == "holder"  # 1.8 steps of 4096 tokens: 1 + 3 x 0.8 units
