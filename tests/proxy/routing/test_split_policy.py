"""The split decision wired into routing, in process: a model with prefill or decode workers gets SplitPolicy
through RoutingService, whose Decision names the generating worker and the legs before it; the legs' bodies are
vLLM's protocol; a large fleet is scored through a per-role shortlist; with no decoder left a prefill worker runs
the request whole; the other models keep their policy."""

from __future__ import annotations

import logging

import orjson

from proxy.config import FleetConfig
from proxy.dataplane.stage_body import PREFILL_PARAMS, RELEASE_MODEL, decode_body, prefill_body, release_body
from proxy.routing.service import RoutingService
from proxy.workers.registry import Registry
from tests.proxy.routing.split_support import LONG, add_worker, pick, request, routing_service


def service(roles: dict[str, str], split: str = "conditional", whole_on_prefill: bool = False
            ) -> tuple[Registry, RoutingService]:
    config = FleetConfig.model_validate({"proxy": {"routing": {"disagg": {"split": split,
                                                                          "whole_on_prefill": whole_on_prefill}}}})
    registry, routing = routing_service(config)
    for wid, role in roles.items():
        add_worker(registry, wid, role, {"kv_connector": "Nixl"}, 0 if role == "prefill" else 32)
    return registry, routing


def test_a_long_prompt_to_busy_decoders_is_split_and_a_short_one_stays_on_a_decoder():
    _, routing = service({"p0": "prefill", "d0": "decode", "d1": "decode"})
    assert routing.policy_for("m").name == "disagg"
    split = pick(routing, request())
    assert split.plan is not None and split.plan.prefill is not None
    assert split.worker.role == "decode" and split.plan.prefill.worker.worker_id == "p0"
    assert split.plan.prefill.prefill_tokens == split.plan.prefill.kv_tokens == request().prompt_tokens
    assert "prefill on p0" in split.plan.plan.describe()
    short = pick(routing, request("What time is it?"))
    assert short.worker.role == "decode" and short.plan is not None and short.plan.whole


def test_with_whole_on_prefill_an_idle_prefill_worker_runs_a_request_whole_until_its_prefills_would_stretch_the_next():
    _, routing = service({"p0": "prefill", "d0": "decode", "d1": "decode"}, whole_on_prefill=True)
    policy = routing.policy_for("m")
    whole = pick(routing, request())
    assert (whole.worker.worker_id, whole.plan.prefill) == ("p0", None)
    assert whole.plan.plan.reason == "aggregated: whole on a prefill worker, sooner than a split"
    routing.begin(whole, policy, request())  # its prefill is p0's pressure now (about 3.5 s over a 10 s window)
    assert routing.split.pressure.rate("p0", 100.0) > 0.3
    nxt = pick(routing, request(LONG + " more"))
    assert nxt.plan.prefill is not None and nxt.worker.role == "decode"


def test_split_always_splits_even_a_short_prompt():
    _, routing = service({"p0": "prefill", "d0": "decode"}, split="always")
    decision = pick(routing, request("What time is it?"))
    assert decision.plan.prefill.worker.worker_id == "p0" and decision.worker.worker_id == "d0"


def test_with_no_decoder_left_a_prefill_worker_serves_the_request_whole():
    _, routing = service({"p0": "prefill", "d0": "decode"}, split="always")
    decision = pick(routing, request(), tried={"d0"})
    assert (decision.worker.worker_id, decision.plan, decision.reason) == ("p0", None, "prefill_worker_whole")


def test_a_large_fleet_is_scored_through_a_shortlist_of_each_role():
    roles = {f"p{i}": "prefill" for i in range(20)} | {f"d{i}": "decode" for i in range(40)}
    _, routing = service(roles, split="always")
    policy = routing.policy_for("m")
    workers = routing.registry.candidates("m")
    shortlist = policy._shortlist(workers, {})
    assert sum(w.role == "prefill" for w in shortlist) == 8 and sum(w.role == "decode" for w in shortlist) == 8
    assert pick(routing, request()).plan.prefill is not None


def test_models_without_split_roles_keep_their_policy():
    _, routing = service({"w0": "both", "w1": "both"})
    assert routing.policy_for("m").name == "kv_aware"
    assert pick(routing, request()).plan is None


def test_the_debug_log_shows_the_plan_its_terms_and_what_it_passed_over(caplog):
    _, routing = service({"p0": "prefill", "d0": "decode", "d1": "decode"})
    with caplog.at_level(logging.DEBUG, logger="kvroute.routing.split"):
        pick(routing, request())
    line = caplog.records[-1].getMessage()
    assert "-> prefill on p0, decode on d" in line and "moved_tokens=" in line and "queue_s=" in line
    assert "passed over: aggregated on d" in line  # the best plan of the other kind first
    caplog.clear()
    pick(routing, request())  # not at debug: nothing logged (and no alternatives built)
    assert not caplog.records


def test_the_legs_speak_vllms_disaggregated_protocol():
    payload = {"model": "alias", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 300,
               "max_completion_tokens": 300, "min_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    prefill = orjson.loads(prefill_body(payload, "m", None))
    assert prefill["kv_transfer_params"] == PREFILL_PARAMS and PREFILL_PARAMS["do_remote_decode"] is True
    assert (prefill["stream"], prefill["max_tokens"], prefill["max_completion_tokens"], prefill["model"]) == \
        (False, 1, 1, "m")
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}
    decode = orjson.loads(decode_body(payload, b"original", "m", params, None))
    assert decode == {**payload, "model": "m", "kv_transfer_params": params}  # the client's request, whole
    assert decode_body(payload, b"original", "m", None, None) == b"original"  # nothing to add: the same bytes
    release = orjson.loads(release_body(params))
    assert release["model"] == RELEASE_MODEL and release["kv_transfer_params"] == params
