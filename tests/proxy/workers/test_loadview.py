"""The load view: projected KV usage between reports, queue depth, and /metrics parsing."""

from __future__ import annotations

import pytest

from proxy.routing_config import AdmissionConfig
from proxy.workers.engine_metrics import parse_engine_metrics
from proxy.workers.loadview import EngineReading, WorkerLoad

DISPATCH_VISIBLE_AFTER_S = AdmissionConfig().dispatch_visible_after_s


def set_rules(load: WorkerLoad, **rules: object) -> None:
    """What a config edit of proxy.routing.admission does to a worker's load view."""
    load.set_rules(load.rules.model_copy(update=rules))


def test_dispatches_since_the_last_report_raise_projected_usage():
    load = WorkerLoad(capacity_tokens=10_000)
    load.record_reading(EngineReading(0.2, 1, 0), now=100.0, source="report")
    load.start_request(1000, now=100.01)
    load.start_request(500, now=100.02)
    assert load.projected_kv_usage(100.03) == pytest.approx(0.35)
    assert load.queue_depth(100.03) == 2


def test_a_later_report_absorbs_what_it_already_includes():
    load = WorkerLoad(capacity_tokens=10_000)
    load.record_reading(EngineReading(0.2, 0, 0), now=100.0, source="report")
    load.start_request(1000, now=100.0)
    load.start_request(1000, now=100.3)
    # 0.3 s after the first dispatch the engine has it; the second is too recent to be included
    load.record_reading(EngineReading(0.3, 1, 0), now=100.3 + DISPATCH_VISIBLE_AFTER_S / 2, source="report")
    assert load.projected_kv_usage(100.36) == pytest.approx(0.4)
    assert load.pending_requests() == 1


def test_the_prefill_backlog_counts_prompts_until_their_first_output_whatever_the_reports_say():
    load = WorkerLoad(capacity_tokens=10_000)
    first = load.start_request(1200, now=1.0, prefill_tokens=1000)
    second = load.start_request(700, now=1.0, prefill_tokens=600)
    load.record_reading(EngineReading(0.0, 0, 2), now=1.5, source="report")  # the reading absorbs the pending...
    assert load.pending_requests() == 0 and load.prefill_backlog == 1600  # ...not the backlog
    load.first_output(first)
    load.first_output(first)  # once only
    assert load.prefill_backlog == 600
    load.finish_request(first)
    load.finish_request(second)  # finished (or failed) without output: no longer ahead either
    assert load.prefill_backlog == 0


def test_without_any_reading_in_flight_counts_stand_in():
    load = WorkerLoad(capacity_tokens=1000)
    first = load.start_request(100, now=1.0)
    second = load.start_request(300, now=1.0)
    assert load.queue_depth(1.0) == 2
    assert load.projected_kv_usage(1.0) == pytest.approx(0.4)
    load.finish_request(first)
    load.finish_request(second)
    assert load.in_flight == 0 and load.projected_kv_usage(2.0) == 0.0


def test_a_request_that_finished_before_the_next_report_stops_counting():
    load = WorkerLoad(capacity_tokens=10_000)
    load.record_reading(EngineReading(0.2, 0, 0), now=100.0, source="report")
    done = load.start_request(1000, now=100.01)
    load.start_request(500, now=100.02)
    load.finish_request(done)
    assert load.projected_kv_usage(100.03) == pytest.approx(0.25)
    assert load.queue_depth(100.03) == 1
    load.record_reading(EngineReading(0.2, 0, 0), now=100.5, source="report")
    assert load.pending_requests() == 0 and load.in_flight == 1


VLLM_METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10.0
"""

LMDEPLOY_METRICS = """\
lmdeploy:gpu_cache_usage_perc 0.7
lmdeploy:num_requests_running 2
lmdeploy:num_requests_waiting 1
lmdeploy:prefix_cache_hit_rate 0.25
"""


def test_vllm_metrics_give_usage_counts_and_capacity():
    reading = parse_engine_metrics(VLLM_METRICS)
    assert reading == EngineReading(0.42, 3, 5, 16 * 2048, 0.0)


def test_lmdeploy_metrics_are_read_too():
    reading = parse_engine_metrics(LMDEPLOY_METRICS)
    assert reading is not None
    assert (reading.kv_usage, reading.num_running, reading.num_waiting, reading.prefix_cache_hit_rate) == (0.7, 2, 1, 0.25)


def test_metrics_without_kv_usage_give_nothing():
    assert parse_engine_metrics("process_cpu_seconds_total 3.0\n") is None


def test_a_snapshot_shows_the_views_of_its_moment_and_is_renewed_by_every_event():
    load = WorkerLoad(capacity_tokens=10_000)

    def check(now: float) -> None:
        snap = load.snapshot(now)
        assert snap.projected_kv_usage == load.projected_kv_usage(now)
        assert snap.pending_kv == load.pending_kv_tokens(now)
        assert snap.pending_prefill == load.pending_prefill_tokens(now)
        assert snap.backlog == load.engine_backlog(now)
        assert snap.oldest_pending_at == load.oldest_pending_at()
        assert snap.in_flight == load.in_flight and snap.capacity == load.capacity_tokens

    first = load.start_request(800, now=99.0, prefill_tokens=300)  # no reading yet: in-flight counts
    check(99.5)
    load.record_reading(EngineReading(0.2, 3, 2), now=100.0, source="report")
    check(100.0)
    second = load.start_request(1000, now=100.01, prefill_tokens=600)
    check(100.02)
    assert load.snapshot(100.02) is load.snapshot(100.03)  # nothing happened in between
    load.finish_request(first)
    check(100.04)
    load.capacity_tokens = 20_000
    check(100.05)
    check(100.01 + load.rules.dispatch_forget_after_s + 0.01)  # the dispatch aged out of the pending counts
    load.finish_request(second)
    check(110.0)


def test_an_engine_that_reported_no_queue_admits_once_what_was_sent_since_has_output():
    load = WorkerLoad(capacity_tokens=10_000)
    # whatever the KV use and the prompts to prefill
    set_rules(load, confirm_above_kv_usage=0.0, confirm_above_prefill_tokens=0)
    load.record_reading(EngineReading(0.5, 4, 0), now=100.0, source="report")
    first = load.start_request(1000, now=100.01, prefill_tokens=900)
    second = load.start_request(1000, now=100.02, prefill_tokens=900)
    set_rules(load, admit_after_output=False)  # the previous default: nothing waited at the report
    assert load.admits() and load.engine_backlog(100.03) == 0
    set_rules(load, admit_after_output=True)
    assert not load.admits() and load.engine_backlog(100.03) == 2 == load.snapshot(100.03).backlog
    assert load.snapshot(100.03).queued == 0  # what surely waits (kv_cost's queueing time): nothing reported
    whole = load.start_request(1000, now=100.035, prefill_tokens=900, streamed=False)  # output only at its end
    assert not whole.unconfirmed and load.engine_backlog(100.035) == 2  # it does not hold the queue
    load.first_output(first)  # the engine took it in and computed its prompt
    assert load.engine_backlog(100.04) == 1 and not load.admits()
    load.finish_request(second)  # gone without output (an error, say): it waits nowhere
    assert load.admits() and load.engine_backlog(100.05) == 0
    third = load.start_request(1000, now=100.06, prefill_tokens=900)
    assert not load.admits()
    # a report that shows the engine's queue empty after the dispatch became visible clears it
    load.record_reading(EngineReading(0.6, 5, 0), now=100.06 + DISPATCH_VISIBLE_AFTER_S + 0.01, source="report")
    assert load.admits() and third.pending is False
    # only while the engine's KV is this full or its prompts to prefill this many: below both, an engine that
    # reported no queue takes what it gets
    load.start_request(1000, now=101.0, prefill_tokens=900)
    assert not load.admits()
    # projected usage 0.6 + 1000 / 10000; prompts to prefill: 900 x 3
    set_rules(load, confirm_above_kv_usage=0.8, confirm_above_prefill_tokens=4000)
    assert load.prefill_backlog == 2700
    assert load.admits() and load.engine_backlog(101.01) == 0
    load.start_request(1500, now=101.02, prefill_tokens=900)  # 0.85
    assert not load.admits() and load.engine_backlog(101.03) == 2
    # or while the prompts it has not prefilled yet would fill more than a step: one sent now would wait behind them
    set_rules(load, confirm_above_kv_usage=0.9)
    assert load.admits()
    load.start_request(100, now=101.04, prefill_tokens=400)  # 3600 + 400 to prefill
    assert not load.admits() and load.engine_backlog(101.05) == 3


def test_with_admit_after_head_the_engines_answer_head_confirms_it_took_the_request_in():
    load = WorkerLoad(capacity_tokens=10_000)
    # whatever is left to prefill
    set_rules(load, admit_after_head=True, admit_after_output=False, confirm_above_prefill_tokens=0)
    load.record_reading(EngineReading(0.5, 4, 0), now=100.0, source="report")
    first = load.start_request(1000, now=100.01, prefill_tokens=900)
    second = load.start_request(1000, now=100.02, prefill_tokens=900)
    assert not load.admits() and load.engine_backlog(100.03) == 2
    load.upstream_head(first)  # its front end handed it to the scheduler: it is not waiting at the door
    assert load.engine_backlog(100.04) == 1 and first.prefilling  # still prefilling: output is another event
    load.first_output(second)  # output implies the head
    assert load.admits() and load.engine_backlog(100.05) == 0
    set_rules(load, admit_after_head=False)
    third = load.start_request(1000, now=100.06, prefill_tokens=900)
    load.upstream_head(third)  # without the knob a head confirms nothing, and nothing waits for one
    assert third.unconfirmed and load.admits()


def test_by_default_an_engine_with_kv_room_and_little_to_prefill_takes_what_it_gets_at_once():
    """Holding a request for an engine that will start it in its next step cannot start it sooner."""
    rules = AdmissionConfig()  # config.yaml's defaults
    assert rules.admit_after_output and rules.confirm_above_kv_usage == 0.9
    assert rules.confirm_above_prefill_tokens == 4096
    load = WorkerLoad(capacity_tokens=100_000)
    load.record_reading(EngineReading(0.3, 16, 0), now=100.0, source="report")
    for i in range(16):  # short prompts, nothing output yet: all of them fit the engine's next step
        load.start_request(300, now=100.001 + i / 1000, prefill_tokens=200)
    assert load.admits() and load.engine_backlog(100.02) == 0
    load.start_request(4000, now=100.02, prefill_tokens=1000)  # 4200 tokens to prefill: more than a step takes
    assert not load.admits() and load.engine_backlog(100.03) == 17
    small = WorkerLoad(capacity_tokens=100_000)  # an engine whose worker says its step takes 2048 tokens: 1024
    small.step_tokens = 2048
    small.record_reading(EngineReading(0.3, 16, 0), now=100.0, source="report")
    for i in range(5):
        small.start_request(300, now=100.001 + i / 1000, prefill_tokens=200)
    assert small.admits()
    small.start_request(300, now=100.01, prefill_tokens=100)  # 1100 tokens to prefill
    assert not small.admits() and small.engine_backlog(100.02) == 6
    fresh = WorkerLoad(capacity_tokens=100_000)  # an engine near its KV size holds even short prompts
    fresh.record_reading(EngineReading(0.89, 16, 0), now=100.0, source="report")
    fresh.start_request(500, now=100.01, prefill_tokens=100)
    fresh.start_request(600, now=100.01, prefill_tokens=100)
    assert not fresh.admits() and fresh.engine_backlog(100.02) == 2
