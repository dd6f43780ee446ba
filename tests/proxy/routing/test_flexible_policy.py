"""A pool of `both` workers whose KV connectors both send and receive (kv_role kv_both): the configured policy
places each request, and its prefill moves to another worker of the pool only when that is predicted sooner
(proxy/routing/flexible.py). Everything else about such a model stays as on an aggregated fleet."""

from __future__ import annotations

from proxy.config import FleetConfig
from proxy.routing.service import RoutingService
from proxy.workers.registry import Registry
from tests.proxy.routing.split_support import LONG, add_worker, pick, request, routing_service

FLEXIBLE = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def service(workers: dict[str, tuple[int, dict[str, str]]]) -> tuple[Registry, RoutingService]:
    """workers: id -> (requests running there, labels)."""
    registry, routing = routing_service(FleetConfig())
    for wid, (running, labels) in workers.items():
        add_worker(registry, wid, "both", labels, running)
    return registry, routing


def test_a_long_prompt_placed_on_a_worker_busy_decoding_is_prefilled_on_one_that_decodes_less():
    # equal KV use and nothing in flight: kv_aware places requests at random among the three
    _, routing = service({"a": (40, FLEXIBLE), "b": (40, FLEXIBLE), "c": (2, FLEXIBLE)})
    assert routing.policy_for("m").name == "disagg"
    placed = {"split": 0, "whole": 0}
    for i in range(12):
        decision = pick(routing, request(f"document {i}: {LONG}"))
        if decision.worker.worker_id == "c":  # placed where little decodes: nothing to gain elsewhere
            assert decision.plan is None
            placed["whole"] += 1
            continue
        # placed on a worker 40 streams decode on: its prefill would stall each of them, c's only 2
        assert decision.plan is not None and decision.plan.prefill is not None, decision
        assert decision.plan.prefill.worker.worker_id == "c"
        assert decision.plan.plan.reason == "split: prefilling on a decoder would stall its running requests"
        assert decision.plan.prefill.prefill_tokens == decision.plan.prefill.kv_tokens > 6000
        placed["split"] += 1
    assert placed["split"] and placed["whole"], placed


def test_a_short_prompt_runs_whole_where_the_configured_policy_placed_it():
    _, routing = service({"a": (40, FLEXIBLE), "b": (2, FLEXIBLE)})
    for i in range(6):
        short = pick(routing, request(f"What time is it in zone {i}?"))
        assert short.plan is None and short.reason != "split"  # it rides in a decode step wherever it lands


def test_workers_without_a_two_way_connector_keep_the_configured_policy():
    one_way = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    _, routing = service({"a": (40, one_way), "b": (2, one_way)})
    assert routing.policy_for("m").name == "kv_aware"
    _, routing = service({"a": (40, {}), "b": (2, {})})
    assert routing.policy_for("m").name == "kv_aware"
    _, routing = service({"a": (40, FLEXIBLE), "b": (2, {})})  # one flexible worker has nobody to share with
    assert routing.policy_for("m").name == "kv_aware"
