"""In-process checks of the quality benchmark's parts: saved workloads, the oracle's prediction, the verdicts.

No processes: the smoke run in test_bench_smoke.py covers the fleet, the routers and the result files.
"""

from __future__ import annotations

import asyncio
import copy
from collections import deque

import pytest

from backends.sim.presets import get_preset
from backends.sim.tokens import Prompt
from bench.loadgen import Result, RunResult
from bench.oracle import Oracle
from bench.oracle_view import (
    Sent,
    WorkerView,
    common_run,
    effective_cached,
    kv_aware_cost,
    owned_blocks,
    predict_ttft_s,
)
from bench.quality import QUICK_DIR, is_quick
from bench.quality_report import aggregate, render, verdicts
from bench.tails import cold_start, ttft_p99_after_first_wave
from bench.workloads import KINDS, MODEL_B, generate, load_or_generate


def test_saved_kv_pressure_workload_fits_the_fleet_but_not_one_worker():
    w = load_or_generate("kv_pressure", 1, 1000)  # the file shipped in bench/workloads/
    assert len(w.requests) == 1000
    ratio = w.shared_prefix_tokens() / w.kv_tokens
    assert 1.0 < ratio < 4.0  # more than one worker's cache...
    assert w.shared_prefix_tokens() < 0.75 * 4 * w.kv_tokens  # ...well inside four workers' caches
    assert any(isinstance(m["content"], list) for r in w.requests for m in r["body"]["messages"])  # images too


def test_every_family_is_seeded_and_sessions_wait_for_their_previous_turn():
    for kind in KINDS:
        a, b = generate(kind, 7, 80), generate(kind, 7, 80)
        assert a.requests == b.requests, kind
        assert len(a.requests) == 80
    s = generate("sessions", 7, 80)
    chained = [(i, r) for i, r in enumerate(s.requests) if "after" in r]
    assert chained
    for i, r in chained:
        prev = s.requests[r["after"]]
        assert r["after"] < i and prev["tag"] == r["tag"]
        # the history grows: the previous turn's messages are a prefix of this one's
        assert r["body"]["messages"][:len(prev["body"]["messages"])] == prev["body"]["messages"]
    two = generate("two_models", 7, 80)
    assert MODEL_B in two.worker_models_for(4) and MODEL_B in {r["body"]["model"] for r in two.requests}
    lengths = generate("lengths", 7, 200)
    sizes = [int(r["tag"][3:]) for r in lengths.requests]
    assert min(sizes) < 300 and max(sizes) > 5000


def _probe(**kw):
    p = {"prompt_tokens": 4000, "cached_tokens": 0, "media_tokens_uncached": 0, "block_size": 16,
         "num_blocks": 2048, "free_blocks": 2048, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
         "waiting": [], "running": []}
    p.update(kw)
    return p


def test_oracle_prefers_the_cached_prefix_and_prices_queues_images_and_full_caches():
    preset = get_preset("h100-qwen3-vl-8b")
    cold = predict_ttft_s(preset, _probe())
    warm = predict_ttft_s(preset, _probe(cached_tokens=3984))
    assert warm < cold
    queued = predict_ttft_s(preset, _probe(cached_tokens=3984, waiting=[[8000, 64]] * 4))
    assert queued > cold  # four cold 8k prompts ahead cost more than prefilling 4k here
    assert predict_ttft_s(preset, _probe(media_tokens_uncached=3072)) > cold
    running = [[0, 100, 100, 1600]] * 16
    full = predict_ttft_s(preset, _probe(free_blocks=10, running=running))
    assert full > predict_ttft_s(preset, _probe(running=copy.deepcopy(running)))


def _row(route, p99, load="closed", hit=0.8, rej=0):
    return {"family": "kv_pressure", "load": load, "route": route, "repeat": 0, "req_per_s": 10.0,
            "makespan_s": 50.0, "ttft_p50": 0.1, "ttft_p99": p99, "goodput_frac": 0.9, "rejected_429": rej,
            "rejected_503": 0, "failed": 0, "prefix_hit": hit, "prefill_tokens": 1000, "preemptions": 0,
            "per_worker": [250, 250, 250, 250]}


def test_verdict_names_each_missed_criterion_and_the_markdown_comes_from_the_rows():
    rows = [_row("kvroute:default", 1.0), _row("kvroute:default", 1.2), _row("sglang-router:cache_aware", 1.0),
            _row("oracle", 0.5), _row("kvroute:default", 0.3, "0.95"), _row("vllm-router:cache_aware", 1.0, "0.95"),
            _row("oracle", 0.3, "0.95")]
    v = {(f, load): text for f, load, text in verdicts(aggregate(rows))}
    assert "TTFT p99 1100 ms > 0.7 x best peer's 1000 ms" in v[("kv_pressure", "closed loop")]
    assert "oracle" in v[("kv_pressure", "closed loop")]
    assert v[("kv_pressure", "95%")] == "meets the bar"
    meta = {"quick": True, "environment": "env", "took_s": 1.0, "command": "kvroute bench quality", "workers": 4,
            "preset": "p", "time_scale": 1.0, "requests": 10, "repeats": 2, "closed_clients": 32,
            "calibrate_routes": "oracle", "ttft_slo": 1.0, "default_policy": "kv_aware",
            "families": {"kv_pressure": {"kv_tokens": 32768, "shared_prefix_tokens": 61000, "capacity": 20.0}}}
    md = render({"meta": meta, "rows": rows})
    assert "NOT MEANINGFUL" in md and "1100 (1000-1200)" in md  # mean (min-max) over the two repeats


def test_a_hit_rate_miss_is_told_to_two_decimals_with_the_prefill_work_behind_it():
    mine, peer = _row("kvroute:default", 0.1, "0.8", hit=0.6447), _row("sglang-router:cache_aware", 1.0, "0.8", hit=0.6481)
    mine["prefill_tokens"], peer["prefill_tokens"] = 846_000, 839_600
    text = verdicts(aggregate([mine, peer]))[0][2]
    assert text == ("prefix hit 64.47% < 64.81% (sglang-router:cache_aware; +6.4k prefilled tokens per run, +0.8%)")
    mine["prefix_hit"] = 0.6481  # equal is no miss
    assert verdicts(aggregate([mine, peer]))[0][2] == "meets the bar"


def test_the_kv_aware_oracle_scores_kvroutes_cost_on_the_true_state():
    holder = _probe(cached_tokens=3984, free_blocks=1500)
    assert kv_aware_cost(holder, 3984, []) < kv_aware_cost(_probe(), 0, [])  # the prefix's holder, lightly loaded
    # the holder with eight cold 8000-token prompts waiting to be prefilled: a copy elsewhere is cheaper
    busy = _probe(cached_tokens=3984, free_blocks=1500, waiting=[[8000, 64]] * 8)
    assert kv_aware_cost(busy, 3984, []) > kv_aware_cost(_probe(), 0, [])
    # what the oracle sent there and the probe does not show yet counts as waiting there
    unseen = [Sent(8000, 500) for _ in range(8)]
    assert kv_aware_cost(holder, 3984, unseen) == pytest.approx(kv_aware_cost(busy, 3984, []) + 8 * 500 / 2048)
    # kv_aware_owner credits a prefix to every worker it was sent to, evicted there since or not
    assert owned_blocks({11, 12, 13}, [11, 12, 14, 13]) == 2 and owned_blocks(set(), [11]) == 0


def test_the_verdict_holds_kvroute_to_the_better_of_the_two_oracles():
    rows = [_row("kvroute:default", 0.5, "0.95"), _row("vllm-router:cache_aware", 1.0, "0.95"),
            _row("oracle", 2.0, "0.95"), _row("oracle:kv_aware", 0.3, "0.95")]
    text = verdicts(aggregate(rows))[0][2]
    assert "p99 > 1.2 x oracle:kv_aware's 300 ms" in text


def test_a_peer_that_lost_requests_is_not_the_bar_while_another_served_everything():
    fast_but_failing = {**_row("sglang-router:cache_aware", 0.2), "makespan_s": 30.0, "failed": 90}
    rows = [_row("kvroute:default", 0.6), fast_but_failing, {**_row("vllm-router:cache_aware", 1.0), "makespan_s": 60.0}]
    text = verdicts(aggregate(rows))[0][2]
    assert text.startswith("meets the bar") and "sglang-router:cache_aware, which lost 90 requests" in text
    # with no peer serving everything, the failing one is the bar all the same
    text = verdicts(aggregate(rows[:2]))[0][2]
    assert "makespan 50.00 vs best peer 30.00" in text


def test_small_runs_are_quick_and_go_outside_the_results_folder():
    assert is_quick(999, 3) and is_quick(1000, 2) and not is_quick(1000, 3)
    assert "results" not in QUICK_DIR.parts


def _feed_line(added=(), removed=(), enqueued=0, reset=False, **queues):
    line = {"added": list(added), "removed": list(removed), "enqueued": enqueued,
            "queues": {**_probe(), **queues}}
    if reset:
        line.update(reset=True, model="m", preset="h100-qwen3-vl-8b")
    return line


def test_the_oracles_mirror_follows_the_feed_and_counts_what_the_engine_has_not_seen_yet():
    w = WorkerView("http://w")
    w.apply(_feed_line([1, 2, 3], reset=True))
    w.apply(_feed_line([4], [2]))
    assert w.cached == {1, 3, 4} and w.model == "m" and w.synced.is_set()
    a, b, c = Sent(100, 7, [1, 5]), Sent(200, 13, [9]), Sent(300, 19, [1, 5, 6])
    for s in (a, b, c):
        w.note_sent(s)
    assert w.unseen() == [a, b, c]
    w.apply(_feed_line(enqueued=2))  # the engine's scheduler got two of them: the last one is still unseen
    assert w.unseen() == [c]
    assert w.pending_prefix_blocks([1, 5, 6, 7]) == 3 and w.pending_prefix_blocks([2]) == 0
    w.note_done(c, enqueued=False)  # refused before the scheduler: it will never show, and is not pending
    assert w.unseen() == [] and w.sent == 2 and w.pending_prefix_blocks([1, 5, 6, 7]) == 2
    # what the oracle scores: the cached run by the mirror, a prefix in flight there counted as cached
    oracle = Oracle(["http://w"], "kv_aware")
    view = oracle.view(w, [1, 5, 8], Prompt(list(range(60)), [(16, 16)]))
    assert view["cached_tokens"] == 16 and view["pending_prefix_tokens"] == 32 and view["media_tokens_uncached"] == 0
    reset = _feed_line([7], reset=True)
    w.apply(reset)  # a reconnect starts over from the whole cache
    assert w.cached == {7}


async def test_the_oracle_holds_while_every_engine_queues_and_releases_in_arrival_order_one_per_free_engine():
    # late binding on the true state (kvroute's admission, without report lag): no timer, feed lines release
    oracle = Oracle(["http://a", "http://b"], "kv_aware")
    a, b = oracle.workers
    for w in (a, b):
        w.apply(_feed_line(reset=True, waiting=[[100, 8]]))
    assert not oracle._admits([a, b]) and oracle._admits([a])  # one candidate: its own queue is as good
    first = asyncio.create_task(oracle._hold("m"))
    second = asyncio.create_task(oracle._hold("m"))
    await asyncio.sleep(0)
    assert not first.done() and not second.done() and oracle.held == 2
    b.apply(_feed_line(waiting=[]))  # b's engine admitted its queue
    oracle._release("m")
    await asyncio.sleep(0)
    assert first.done() and not second.done()  # the head only, until it is sent
    oracle._release("m")
    await asyncio.sleep(0)
    assert not second.done()
    b.note_sent(Sent(100, 7, [5]))  # the head goes to b: b has a request its scheduler has not seen yet
    oracle._releasing.discard("m")
    oracle._release("m")
    await asyncio.sleep(0)
    assert not second.done() and not oracle._admits([a, b])
    b.apply(_feed_line(enqueued=1, waiting=[]))  # b's scheduler took it and still has room
    oracle._release("m")
    await second
    assert oracle._fifo["m"] == deque()


def test_oracle_counts_a_prefix_being_computed_there_as_good_as_cached():
    assert common_run([1, 2, 3, 4], [1, 2, 9]) == 2 and common_run([], [1]) == 0
    probe = _probe(cached_tokens=0, pending_prefix_tokens=3200)
    assert effective_cached(probe) == 3200
    preset = get_preset("h100-qwen3-vl-8b")
    assert predict_ttft_s(preset, probe) < predict_ttft_s(preset, _probe())


def test_closed_loop_tail_after_the_first_wave_leaves_out_the_cold_start():
    """Every client's first request meets a cold fleet at once: that wave is reported apart from the loop's tail."""
    cold = [Result(i, "", 200, sent_at=0.0, latency_s=2.0, ttft_s=1.5 + i / 100) for i in range(20)]
    warm = [Result(20 + i, "", 200, sent_at=2.0 + i / 10, latency_s=0.5, ttft_s=0.1 + i / 1000) for i in range(200)]
    run = RunResult(cold + warm, wall_s=25.0, started_at=0.0)
    assert 0.1 < ttft_p99_after_first_wave(run) < 0.3  # the cold requests' 1.5 s are not in it
    rows = [{**_row("kvroute:default", 1.6), "ttft_p99_warm": 0.2}, {**_row("sglang-router:cache_aware", 1.4),
                                                                     "ttft_p99_warm": 0.5}]
    text = verdicts(aggregate(rows))[0][2]
    assert "TTFT p99 1600 ms" in text and "(after the first wave: p99 200 ms vs best peer's 500 ms)" in text


def test_ttft_floor_prices_only_what_no_earlier_request_presented():
    from bench.ttft_floor import closed_wave_floor_s, compare, family_floors, p99, request_floor_s

    preset = get_preset("h100-qwen3-vl-8b")
    ids = list(range(4000))
    cold, warm = request_floor_s(preset, ids, [], 0), request_floor_s(preset, ids, [], 3840)
    assert cold > 5 * warm > 0  # a cached 3840-token prefix leaves a one-block prefill
    assert request_floor_s(preset, ids, [(0, 1000)], 0) > cold  # uncached image tokens cost the vision encoder
    assert request_floor_s(preset, ids, [], 4000) == request_floor_s(preset, ids, [], 3999)  # the last token is computed
    # sessions: each of the 8 system prompts is cold once; later turns prefill their new messages only
    floors = family_floors("sessions", preset)
    assert len(floors) == 1000 and sum(f > 0.030 for f in floors) == 8
    assert p99(floors) < 0.030 < max(floors)
    rows = [{"family": "sessions", "load": 0.5, "route": route, "ttft_p99": value}
            for route, value in (("kvroute:default", 0.038), ("sglang-router:cache_aware", 0.048),
                                 ("sglang-router:cache_aware", 0.050), ("oracle", 0.001))]
    table = compare({"rows": rows}, {"sessions": 0.040})
    assert table[-1] == "| sessions | 0.5 | 40 | 49 | 34 | 38 | no: below the floor |"  # the oracle is no peer
    # a closed loop's first wave: 128 cold requests on 4 workers take longer than any one of them alone,
    # half the workers take twice as long, and leaving more requests out of the bound lowers it
    wave = closed_wave_floor_s("sessions", preset, 128, 4)
    assert wave > max(floors) and closed_wave_floor_s("sessions", preset, 128, 2) == pytest.approx(2 * wave)
    assert closed_wave_floor_s("sessions", preset, 128, 4, slower=40) < wave
    closed_rows = [{**row, "load": "closed"} for row in rows]
    assert compare({"rows": closed_rows}, {"sessions": 0.010}, {"sessions": 0.020})[-1].startswith(
        "| sessions | closed | 20 | 49 | 34 | 38 | yes")


def test_queue_floor_queues_prefills_on_the_engine_that_frees_first_with_one_pooled_cache():
    from bench.traces import TraceRequest
    from bench.ttft_floor import queue_floor, request_floor_s

    preset = get_preset("h100-qwen3-vl-8b")
    alone = request_floor_s(preset, [0] * 2048, [], 0)
    a, b = TraceRequest(0.0, 2048, 8, (1, 2, 3, 4)), TraceRequest(0.0, 2048, 8, (5, 6, 7, 8))
    # one engine: the second waits out the first's prefill; two engines: neither waits
    ttfts, hit = queue_floor([a, b], preset, 1, 100_000, 1.0)
    assert ttfts == pytest.approx([alone, 2 * alone]) and hit == 0.0
    assert queue_floor([a, b], preset, 2, 100_000, 1.0)[0] == pytest.approx([alone, alone])
    # arrivals far enough apart (at the replay's speed-up) never queue
    late = TraceRequest(10 * alone, 2048, 8, (5, 6, 7, 8))
    assert queue_floor([a, late], preset, 1, 100_000, 1.0)[0] == pytest.approx([alone, alone])
    assert queue_floor([a, late], preset, 1, 100_000, 20.0)[0][1] > alone
    # a repeat finds every block but its last token cached, on any engine, while the pooled cache holds it
    again = TraceRequest(10 * alone, 2048, 8, (1, 2, 3, 4))
    ttfts, hit = queue_floor([a, again], preset, 2, 100_000, 1.0)
    assert hit == pytest.approx(2047 / 4096) and ttfts[1] == pytest.approx(request_floor_s(preset, [0] * 2048, [], 2047))
    # the fleet's KV (2 engines x 1024 tokens: 4 blocks) holds the last request's blocks only
    assert queue_floor([a, b, again], preset, 2, 1024, 1.0)[1] == 0.0


def test_cold_first_uses_are_told_apart_from_the_tail_a_route_makes():
    w = generate("sessions", 3, 300)  # 8 system prompts; every session's first turn presents one
    firsts: dict = {}
    for i in range(300):
        firsts.setdefault(w.shared_prefix_key(i), i)
    cold = set(firsts.values())
    assert len(cold) == 8 and None not in firsts
    # the slow requests are the cold first uses (and one warm request); the rest take 10-40 ms
    results = [Result(i, "", 200, sent_at=w.requests[i]["t"], latency_s=1.0,
                      ttft_s=0.2 if i in cold or i == 299 else 0.01 + (i % 31) / 1000) for i in range(300)]
    stats = cold_start(w, RunResult(results, wall_s=30.0, started_at=0.0))
    assert stats["cold_first_uses"] == 8
    assert stats["cold_in_slowest_1pct"] == 3  # the slowest 3 of 300 are all 200 ms; the warm one is among 9
    assert 0.03 < stats["ttft_p99_seen"] < 0.2  # 1 slow request in 292 is under the 1% the p99 cuts off
    rows = [{**_row("kvroute:default", 0.2), "ttft_p99_seen": 0.04, "cold_in_slowest_1pct": 3},
            {**_row("sglang-router:cache_aware", 0.2), "ttft_p99_seen": 0.06, "cold_in_slowest_1pct": 3}]
    text = verdicts(aggregate(rows))[0][2]
    assert "(3.0 of kvroute's slowest 1% are cold first uses of a shared prefix; without them p99 40 ms" in text


def test_warm_up_sends_each_shared_prefix_once_and_no_measured_question():
    w = load_or_generate("kv_pressure", 1, 1000)  # 8 system prompts and 8 system prompt + image prefixes
    warm = w.warm_up_specs("s", 1000)
    assert len(warm) == 16 and all(s.body["max_tokens"] == 1 for s in warm)
    measured = w.specs(1.0, salt="s", limit=1000)
    questions = {str(m["content"]) for s in measured for m in s.body["messages"][1:]}
    for s in warm:
        system, user = s.body["messages"]
        assert system in [m.body["messages"][0] for m in measured]  # the very prefix a measured request sends
        assert str(user["content"]) not in questions
    with_image = [s for s in warm if isinstance(s.body["messages"][1]["content"], list)]
    assert len(with_image) == 8 and all(s.body["messages"][1]["content"][0]["type"] == "image_url" for s in with_image)
