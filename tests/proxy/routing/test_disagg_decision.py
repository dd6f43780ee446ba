"""The disaggregation decision on hand-built views: split only when it is predicted faster or spares the decoders,
keep a request where its prefix is, mind the link and the decoders' KV room, send images to the encoder that has
them; its times are kv_cost's."""

from __future__ import annotations

import orjson
import pytest

from proxy.pools import link
from proxy.request import CHAT, parse_request
from proxy.routing.disagg import LinkView, RequestView, WorkerView, plan, view_of
from proxy.routing.estimator import WorkerModel
from proxy.routing.kv_cost import predict
from proxy.workers.loadview import EngineReading
from proxy.workers.registry import Worker

QWEN_8B_KV = 2 * 36 * 8 * 128 * 2  # bytes per token: K and V x layers x KV heads x head dim x bf16
QWEN_32B_KV = 2 * 64 * 8 * 128 * 2
RDMA = LinkView.of(link("rdma-400g"), QWEN_8B_KV, encoder_bytes_per_token=4096 * 2 * 4)


def fleet(prefill_queue_s: float = 0.0, decoding: int = 0, prefill_waiting: int = 0, prefill_pressure: float = 0.5,
          **decoder) -> list[WorkerView]:
    """Two prefill and three decode workers at the estimator's priors (0.1 ms per prompt token, 20 ms a step); the
    prefill pool busy by default (its prefills stalled a decoding request half of the last while)."""
    return [*(WorkerView(f"p{i}", "prefill", queue_s=prefill_queue_s, decoding=prefill_waiting,
                         pressure=prefill_pressure) for i in range(2)),
            *(WorkerView(f"d{i}", "decode", decoding=decoding, **decoder) for i in range(3))]


def test_a_short_prompt_is_prefilled_where_it_decodes():
    chosen = plan(RequestView(prompt_tokens=200), fleet(decoding=8), RDMA)
    assert chosen.kind == "aggregated" and chosen.worker.startswith("d")
    assert "short" in chosen.reason


def test_a_long_cold_prompt_goes_to_the_prefill_pool_when_the_decoders_are_busy():
    chosen = plan(RequestView(prompt_tokens=8000), fleet(decoding=32), RDMA, explain=True)
    assert (chosen.kind, chosen.prefill[0], chosen.decode[0]) == ("disaggregated", "p", "d")
    assert chosen.terms["moved_tokens"] == 8000 and chosen.terms["stall_s"] == 0.0
    assert "stall" in chosen.reason
    assert chosen.alternatives[0][0].startswith("aggregated")  # the decision log shows what it passed over


def test_with_nothing_decoding_a_split_only_adds_the_transfer():
    chosen = plan(RequestView(prompt_tokens=8000), fleet(decoding=0), RDMA)
    assert chosen.kind == "aggregated"


def test_a_decoder_holding_most_of_the_prompt_prefills_the_rest_itself():
    views = fleet(decoding=4)
    views[3] = WorkerView("d-warm", "decode", decoding=4, cached_tokens=7000)
    chosen = plan(RequestView(prompt_tokens=8000), views, RDMA)
    assert (chosen.kind, chosen.worker) == ("aggregated", "d-warm")
    assert chosen.reason == "aggregated: it holds most of the prompt"
    cold = plan(RequestView(prompt_tokens=8000), fleet(decoding=4), RDMA)
    assert cold.kind == "disaggregated"  # the same load, nobody holding the prompt: split


def test_a_split_moves_only_what_the_decoder_lacks_and_prefers_the_decoder_that_has_it():
    views = fleet(decoding=32)
    views[4] = WorkerView("d-warm", "decode", decoding=32, cached_tokens=6000)
    chosen = plan(RequestView(prompt_tokens=8000), views, RDMA)
    assert (chosen.kind, chosen.decode, chosen.terms["moved_tokens"]) == ("disaggregated", "d-warm", 2000)


def test_a_slow_link_keeps_the_request_where_a_fast_one_splits_it():
    request = RequestView(prompt_tokens=4000)
    tcp = LinkView.of(link("tcp-25g"), QWEN_32B_KV)
    nvlink = LinkView.of(link("nvlink"), QWEN_32B_KV)
    assert plan(request, fleet(decoding=1), tcp).kind == "aggregated"  # 1 GB at 2.5 GB/s: 0.42 s
    assert plan(request, fleet(decoding=1), nvlink).kind == "disaggregated"


def test_a_queued_prefill_pool_is_not_worth_waiting_for():
    chosen = plan(RequestView(prompt_tokens=2000), fleet(prefill_queue_s=5.0, decoding=4), RDMA)
    assert chosen.kind == "aggregated"


def test_the_decoder_without_kv_room_is_passed_over():
    views = fleet(decoding=32)
    views[2:] = [WorkerView("d-full", "decode", decoding=32, kv_free_tokens=0, kv_release_tokens_per_s=1000),
                 WorkerView("d-room", "decode", decoding=32, kv_free_tokens=100_000)]
    chosen = plan(RequestView(prompt_tokens=8000), views, RDMA, explain=True)
    assert chosen.decode == "d-room"
    assert any("d-full" in label and cost > 8 for label, cost in chosen.alternatives)  # 8 s waiting for room
    assert plan(RequestView(prompt_tokens=8000), views, RDMA).alternatives == ()  # only when asked to explain


def test_with_whole_on_prefill_an_idle_prefill_worker_runs_a_request_whole_rather_than_add_a_transfer():
    idle = fleet(decoding=32, prefill_pressure=0.0)
    assert plan(RequestView(prompt_tokens=8000), idle, RDMA).kind == "disaggregated"  # the default: it only prefills
    chosen = plan(RequestView(prompt_tokens=8000), idle, RDMA, whole_on_prefill=True)
    assert (chosen.kind, chosen.worker) == ("aggregated", "p0")
    assert chosen.reason == "aggregated: whole on a prefill worker, sooner than a split"
    # the same prefill worker busy with the pool's prefills: the request would decode between them, so it splits
    busy = plan(RequestView(prompt_tokens=8000), fleet(decoding=32, prefill_pressure=0.5), RDMA, whole_on_prefill=True)
    assert busy.kind == "disaggregated" and busy.terms["decode_s"] == pytest.approx(256 * 0.02)


def test_requests_run_whole_on_the_prefill_pool_only_when_the_decoders_step_slower_than_its_prefills_stretch_it():
    request = RequestView(prompt_tokens=300, expected_output_tokens=100)  # decode on p: 100 x 20 ms x 1.5 = 3 s
    stays = plan(request, fleet(decoding=32, decode_step_s=0.025), RDMA, whole_on_prefill=True)  # 2.5 s
    assert (stays.decode or stays.worker).startswith("d")
    spilled = plan(request, fleet(decoding=32, decode_step_s=0.035), RDMA, whole_on_prefill=True)  # 3.5 s
    assert spilled.kind == "aggregated" and spilled.worker.startswith("p")
    assert spilled.terms["decode_s"] == pytest.approx(3.0)


def test_every_request_split_keeps_the_prefill_pool_to_prefills():
    idle = fleet(decoding=0, prefill_pressure=0.0)
    chosen = plan(RequestView(prompt_tokens=8000), idle, RDMA, split="always", whole_on_prefill=True)
    assert chosen.kind == "disaggregated"


def test_an_aggregated_fleet_and_one_that_cannot_generate():
    both = [WorkerView("w0", "both", decoding=64), WorkerView("w1", "both", queue_s=1.0, decoding=64)]
    assert plan(RequestView(prompt_tokens=8000), both, RDMA).worker == "w0"  # no prefill pool: nothing to split
    only_prefill = [WorkerView("p0", "prefill")]
    assert plan(RequestView(prompt_tokens=500), only_prefill, RDMA, whole_on_prefill=True).worker == "p0"
    with pytest.raises(ValueError):  # by default a prefill worker only prefills (split.py then runs it whole there)
        plan(RequestView(prompt_tokens=500), only_prefill, RDMA)
    with pytest.raises(ValueError):
        plan(RequestView(prompt_tokens=500, media_tokens=100, media_hashes=("a",)), encoders(frozenset()), RDMA)


def encoders(*caches: frozenset[str], queue_s: float = 0.0) -> list[WorkerView]:
    return [WorkerView(f"e{i}", "encode", queue_s=queue_s, encoder_cache=c) for i, c in enumerate(caches)]


def test_an_image_goes_to_the_encoder_that_has_it_cached_then_to_the_prefill():
    image = RequestView(prompt_tokens=6000, media_tokens=4000, media_hashes=("img-a",))
    views = fleet(decoding=32) + encoders(frozenset(), frozenset({"img-a"}), frozenset())
    chosen = plan(image, views, RDMA)
    assert (chosen.kind, chosen.encode) == ("disaggregated", "e1")
    text = plan(RequestView(prompt_tokens=6000), views, RDMA)
    assert text.encode is None


def test_a_new_image_meets_the_same_encoder_every_time_and_images_spread_over_encoders():
    # while the request would wait for the prefill pool anyway, an encoder runs its vision tower meanwhile
    views = fleet(prefill_queue_s=0.5, decoding=32) + encoders(frozenset(), frozenset(), frozenset())
    picks = {h: plan(RequestView(6000, 4000, (h,)), views, RDMA).encode for h in (f"img-{i}" for i in range(24))}
    assert picks == {h: plan(RequestView(6000, 4000, (h,)), views, RDMA).encode for h in picks}
    assert len(set(picks.values())) == 3


def test_a_busy_encoder_pool_is_skipped_for_the_prefill_workers_own_vision_tower():
    views = fleet(decoding=32) + encoders(frozenset(), queue_s=10.0)
    chosen = plan(RequestView(6000, 4000, ("img-a",)), views, RDMA)
    assert chosen.kind == "disaggregated" and chosen.encode is None


def test_times_are_kv_costs_own_for_the_same_worker():
    w = Worker("w", "http://w", ["m"], capacity_tokens=100_000)
    w.load.record_reading(EngineReading(0.2, 3, 1, 100_000), 10.0, "report")
    model = WorkerModel()
    model.observe_report(prefill_tokens_per_s=5000.0, decode_step_s=0.03)
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "harbour " * 800}]}
    request = parse_request(orjson.dumps(body), CHAT)
    expected = predict(w, model, request, cached=0, hot_tokens=0, now=10.0)
    view = view_of("w", "both", w.load.snapshot(10.0), model, expected.queue_s, 0, request.expected_output_tokens)
    chosen = plan(RequestView(request.prompt_tokens, expected_output_tokens=50), [view], RDMA)
    assert chosen.ttft_s == pytest.approx(expected.ttft_s)
    work = expected.prefill_s - model.bias_s
    assert chosen.terms["stall_s"] == pytest.approx((work - model.decode_step_s) * 3)  # three running there
    assert view.kv_free_tokens == pytest.approx(100_000 * 0.8)


def test_by_slowdown_a_queued_prefill_pool_loses_to_a_brief_stall_of_long_streams_which_request_seconds_splits():
    # an 8000-token document (0.8 s of prefill at the priors) against a prefill pool with 3 s of queue; 32 streams
    # decode on each decoder for another 10 s. Prefilled there it delays each of them 0.78 s: 25 request-seconds,
    # but 8% of their decode time each, against 3 s more (4.75x its prefill time) for the document itself.
    views = fleet(prefill_queue_s=3.0, decoding=32, turnover_s=10.0)
    by_slowdown = plan(RequestView(prompt_tokens=8000), views, RDMA, slowdown=True)
    assert by_slowdown.kind == "aggregated" and by_slowdown.worker.startswith("d")
    assert by_slowdown.ttft_s < 1.0
    by_seconds = plan(RequestView(prompt_tokens=8000), views, RDMA)
    assert by_seconds.kind == "disaggregated" and by_seconds.ttft_s > 3.0
    # an idle prefill pool: a split costs the document only the transfer, so it splits either way
    idle = fleet(prefill_queue_s=0.0, decoding=32, turnover_s=10.0)
    assert plan(RequestView(prompt_tokens=8000), idle, RDMA, slowdown=True).kind == "disaggregated"
