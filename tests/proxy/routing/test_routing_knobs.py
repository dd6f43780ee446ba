"""Routing knobs in config.yaml: they reach the decision, per model over the fleet's, change live, and bad ones
are refused by key path and line.

Driven through the proxy's own app (build_app, apply_config) and its routing service (the routing's pick),
on a real Registry fed load reports: the same path a request and a config edit take, without the sockets.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.app import REGISTRY_KEY, ROUTING_KEY, apply_config, build_app
from proxy.config import ConfigError, parse_config
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.request import CHAT, parse_request

# a: little KV in use but 10 requests queued; b: more KV in use, nothing queued. kv_aware's default weighs a
# queued request at 0.02 of a full cache, so b costs less (0.40 < 0.30 + 10 x 0.02); without that weight, a.
LOADS = {"a": (0.30, 10), "b": (0.40, 0)}
SYSTEM = "You answer questions about bicycles, briefly and with the manual's section numbers. " * 12


def fleet(yaml: str, models: tuple[str, ...] = ("m",)):
    app = build_app(parse_config(yaml, env={}))
    registry = app[REGISTRY_KEY]
    for seq, (wid, (usage, waiting)) in enumerate(LOADS.items()):
        registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}.test", models=list(models),
                                             engine="sim", kv_capacity_tokens=100_000))
        registry.record_report(wid, LoadReport(worker_id=wid, url=f"http://{wid}.test", models=list(models),
                                               kv_cache_usage=usage, kv_capacity_tokens=100_000,
                                               num_running=4, num_waiting=waiting, seq=seq + 1))
    return app


def pick(app, model: str = "m", system: str | None = None) -> str:
    """The worker the running proxy's routing service picks for one chat request (as the data plane asks)."""
    routing = app[ROUTING_KEY]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi"}]
    routed = parse_request(orjson.dumps({"model": model, "messages": messages, "max_tokens": 8}), CHAT)
    decision = asyncio.run(routing.pick(routing.live.policies.for_model(model), routed, model, set(), True))
    assert decision is not None
    return decision.worker.worker_id


def test_a_knob_set_in_config_yaml_changes_the_pick():
    assert pick(fleet("proxy: {policy: kv_aware}\n")) == "b"
    assert pick(fleet("proxy:\n  routing:\n    kv_aware: {queue_weight: 0}\n")) == "a"


def test_a_models_own_knobs_beat_the_fleets_and_leave_other_models_alone():
    app = fleet("proxy:\n  routing:\n    kv_aware: {queue_weight: 0}\n"
                "models:\n  - {name: m, engine: sim, routing: {kv_aware: {queue_weight: 0.05}}}\n"
                "  - {name: n, engine: sim}\n", models=("m", "n"))
    assert pick(app, "m") == "b"  # its own 0.05: a's queue costs 0.5
    assert pick(app, "n") == "a"  # the fleet's 0
    own = app[ROUTING_KEY].live.policies.for_model("m").knobs.kv_aware
    assert own.queue_weight == 0.05 and own.prefix_weight == 1.0  # the keys it does not set: the fleet's


def test_a_live_edit_changes_the_next_pick_and_keeps_what_the_policies_learnt():
    app = fleet("proxy: {policy: kv_aware}\n")
    routing = app[ROUTING_KEY]
    policy = routing.live.policies.for_model("m")
    index, estimator = routing.live.policies.deps.prefix_index, routing.live.policies.deps.estimator
    # something learnt: a prompt's prefix sent to b, and b's measured prefill cost
    routed = parse_request(orjson.dumps({"model": "m", "max_tokens": 8, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}), CHAT)
    decision = asyncio.run(routing.pick(policy, routed, "m", set(), True))
    assert decision is not None and decision.worker.worker_id == "b"
    routing.end(routing.begin(decision, policy, routed), None)
    estimator.for_worker("b").observe_prefill(2000, 0, 0.5)
    learnt_theta, fleet_s_per_token = list(estimator.for_worker("b").theta), estimator.for_worker("a").s_per_token

    change = apply_config(app, parse_config(
        "proxy:\n  routing:\n    kv_aware: {queue_weight: 0}\n    estimator: {prior_prefill_tokens_per_s: 5000}\n"
        "    prefix_index: {ttl_s: 60}\n", env={}))
    assert change.live == ["proxy.routing"]
    assert pick(app) == "a"  # from the next request
    assert routing.live.policies.for_model("m") is policy and policy.knobs.kv_aware.queue_weight == 0
    now = app[REGISTRY_KEY].clock()
    assert index.ttl_s == 60 and index.match(routed.prefix_hashes, None, now) == {"b": len(routed.prefix_hashes)}
    assert estimator.for_worker("b").theta == learnt_theta  # measured: kept
    # a, never measured, is still priced like its measured sibling (the fleet's learnt cost), not by the new prior
    assert estimator.for_worker("a").s_per_token == fleet_s_per_token != 1 / 5000


def test_a_live_edit_of_the_admission_rules_releases_what_they_no_longer_hold():
    # both engines reported no queue, then got prompts they have not answered: under admit_after_output (with
    # thresholds at 0) neither may have taken its own in, so a third request waits in the proxy's queue
    held = "proxy:\n  queue: {max_wait_s: 60}\n  routing:\n    admission: {confirm_above_kv_usage: 0, " \
           "confirm_above_prefill_tokens: 0}\n"
    app = fleet(held)
    routing, registry = app[ROUTING_KEY], app[REGISTRY_KEY]
    for seq, wid in enumerate(("a", "b"), start=10):
        registry.record_report(wid, LoadReport(worker_id=wid, url=f"http://{wid}.test", models=["m"],
                                               kv_cache_usage=0.2, kv_capacity_tokens=100_000, num_running=1,
                                               num_waiting=0, seq=seq))
        registry.get(wid).load.start_request(500, registry.clock(), prefill_tokens=400)
    routed = parse_request(orjson.dumps({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}]}), CHAT)

    async def scenario() -> str:
        waiter = asyncio.create_task(routing.pick(routing.live.policies.for_model("m"), routed, "m", set(), True))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiter.done() and routing.queue_lengths() == {"m": 1}
        apply_config(app, parse_config(held.replace("admission: {", "admission: {admit_after_output: false, "),
                                       env={}))
        decision = await asyncio.wait_for(waiter, 5)  # released by the edit itself: no report, no finish
        return decision.worker.worker_id

    assert asyncio.run(scenario()) in ("a", "b")
    assert all(w.load.rules.admit_after_output is False for w in registry.workers())


def test_kv_costs_knobs_and_a_smaller_prefix_index_apply_live():
    app = fleet("proxy: {policy: kv_cost}\n")
    routing = app[ROUTING_KEY]
    index = routing.live.policies.deps.prefix_index
    for i in range(4):
        pick_and_send(app, f"{SYSTEM} variant {i}")
    assert len(index) > 8
    apply_config(app, parse_config("proxy:\n  policy: kv_cost\n  routing:\n    kv_cost: {resolution_s: 0.5}\n"
                                   "    prefix_index: {max_blocks: 8}\n"
                                   "    estimator: {prior_prefill_tokens_per_s: 5000}\n", env={}))
    assert len(index) == 8  # the least recently used beyond the new size are gone at once
    assert routing.live.policies.for_model("m").config.resolution_s == 0.5
    # nothing measured or reported a prefill rate yet: the new prior prices every worker
    estimator = routing.live.policies.deps.estimator
    assert estimator.for_worker("a").s_per_token == estimator.for_worker("new").s_per_token == 1 / 5000


def pick_and_send(app, system: str) -> None:
    routing = app[ROUTING_KEY]
    policy = routing.live.policies.for_model("m")
    routed = parse_request(orjson.dumps({"model": "m", "max_tokens": 8, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}]}), CHAT)
    decision = asyncio.run(routing.pick(policy, routed, "m", set(), True))
    assert decision is not None
    routing.end(routing.begin(decision, policy, routed), None)


@pytest.mark.parametrize(("yaml", "message"), [
    ("proxy:\n  routing:\n    kv_aware:\n      prefix_wieght: 1\n",
     r"proxy\.routing\.kv_aware\.prefix_wieght \(line 4\): unknown key"),
    ("proxy:\n  routing:\n    kv_cost: {resolution_s: 0}\n",
     r"proxy\.routing\.kv_cost\.resolution_s \(line 3\): must be > 0"),
    ("proxy:\n  routing:\n    admission:\n      admit_after_output: sometimes\n",
     r"proxy\.routing\.admission\.admit_after_output \(line 4\): Input should be a valid boolean"),
    ("models:\n  - name: m\n    engine: sim\n    routing:\n      kv_aware: {queue_weight: -1}\n",
     r"models\[0\]\.routing\.kv_aware\.queue_weight \(line 5\): must be >= 0"),
    ("models:\n  - name: m\n    engine: sim\n    routing:\n      admission: {admit_after_head: true}\n",
     r"models\[0\]\.routing \(line 5\): admission: one per proxy .* set it under proxy\.routing"),
])
def test_bad_knobs_are_refused_with_their_key_path_and_line(yaml, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(yaml, env={})
