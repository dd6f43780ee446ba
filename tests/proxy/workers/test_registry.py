"""Worker states and transitions: ready, stale, unhealthy, draining, and recovery."""

from __future__ import annotations

from proxy.protocol import STALE_AFTER_S, LoadReport, WorkerRegistration
from proxy.workers.registry import BreakerState, CircuitBreaker, Registry, WorkerState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(worker_id: str, seq: int, usage: float = 0.1, state: str = "ready") -> LoadReport:
    return LoadReport(worker_id=worker_id, url="http://w", models=["m"], kv_cache_usage=usage,
                      kv_capacity_tokens=1000, num_running=0, num_waiting=0, seq=seq, state=state)


def make(clock: Clock) -> tuple[Registry, str]:
    registry = Registry(clock=clock)
    worker = registry.register(WorkerRegistration(worker_id="a", url="http://w:1", models=["m"]))
    return registry, worker.worker_id


def test_reports_keep_a_worker_ready_and_silence_makes_it_stale_then_a_report_recovers_it():
    clock = Clock()
    registry, wid = make(clock)
    registry.record_report(wid, report(wid, 1))
    worker = registry.get(wid)
    assert worker.state(clock()) is WorkerState.READY
    clock.now += STALE_AFTER_S + 0.1
    assert worker.state(clock()) is WorkerState.STALE
    registry.record_report(wid, report(wid, 2))
    assert worker.state(clock()) is WorkerState.READY


def test_stale_workers_are_candidates_only_when_no_ready_one_exists():
    clock = Clock()
    registry, a = make(clock)
    registry.register(WorkerRegistration(worker_id="b", url="http://w:2", models=["m"]))
    clock.now += STALE_AFTER_S + 0.1
    registry.record_report("b", report("b", 1))
    assert [w.worker_id for w in registry.candidates("m")] == ["b"]
    registry.drain("b")
    assert [w.worker_id for w in registry.candidates("m")] == [a]


def test_a_failed_probe_makes_a_worker_unhealthy_and_a_new_report_brings_it_back():
    clock = Clock()
    registry, wid = make(clock)
    worker = registry.get(wid)
    registry.record_probe(worker, ok=False, error="refused")
    assert worker.state(clock()) is WorkerState.UNHEALTHY
    assert registry.candidates("m") == []
    registry.record_report(wid, report(wid, 1))
    assert worker.state(clock()) is WorkerState.READY


def test_an_open_circuit_excludes_a_worker_until_its_cooldown_ends():
    clock = Clock()
    registry, wid = make(clock)
    registry.record_report(wid, report(wid, 1))
    worker = registry.get(wid)
    for _ in range(CircuitBreaker.FAILURES_TO_OPEN - 1):
        assert not registry.record_failure(worker, "500")
    assert registry.record_failure(worker, "500")
    assert worker.state(clock()) is WorkerState.UNHEALTHY
    clock.now += CircuitBreaker.BASE_COOLDOWN_S + 0.01
    registry.record_report(wid, report(wid, 2))
    assert worker.state(clock()) is WorkerState.READY  # half-open: one trial
    assert registry.record_failure(worker, "500")      # the trial failed: open again at once
    assert worker.breaker.open_until - clock() == CircuitBreaker.BASE_COOLDOWN_S * 2


def test_a_breaker_says_which_state_it_is_in_as_it_opens_half_opens_and_closes():
    breaker, now = CircuitBreaker(), 100.0
    assert breaker.state(now) is BreakerState.CLOSED
    for _ in range(CircuitBreaker.FAILURES_TO_OPEN - 1):
        assert not breaker.record_failure(now)
    assert breaker.state(now) is BreakerState.CLOSED
    assert breaker.record_failure(now) and breaker.state(now) is BreakerState.OPEN
    now += CircuitBreaker.BASE_COOLDOWN_S
    assert breaker.state(now) is BreakerState.HALF_OPEN  # the cooldown is over: requests are trials
    assert breaker.record_failure(now) and breaker.state(now) is BreakerState.OPEN  # a failed trial
    assert breaker.state(now + CircuitBreaker.BASE_COOLDOWN_S) is BreakerState.OPEN  # for twice as long
    breaker.half_open()  # the worker shows it is alive: no need to wait out the cooldown
    assert breaker.state(now) is BreakerState.HALF_OPEN
    breaker.record_success()
    assert breaker.state(now) is BreakerState.CLOSED and breaker.cooldown_s == CircuitBreaker.BASE_COOLDOWN_S


def test_draining_is_reported_or_requested_and_takes_no_new_work():
    clock = Clock()
    registry, wid = make(clock)
    registry.record_report(wid, report(wid, 1, state="draining"))
    assert registry.get(wid).state(clock()) is WorkerState.DRAINING
    assert registry.candidates("m") == []


def test_older_reports_do_not_overwrite_newer_ones():
    clock = Clock()
    registry, wid = make(clock)
    registry.record_report(wid, report(wid, 5, usage=0.5))
    registry.record_report(wid, report(wid, 4, usage=0.1))
    assert registry.get(wid).load.reading.kv_usage == 0.5


def test_registering_again_keeps_in_flight_counts_and_one_url_is_one_worker():
    clock = Clock()
    registry, wid = make(clock)
    registry.get(wid).load.start_request(10, clock())
    again = registry.register(WorkerRegistration(worker_id=wid, url="http://w:1", models=["m", "m2"]))
    assert again.load.in_flight == 1 and again.models == ("m", "m2")
    registry.register(WorkerRegistration(worker_id="renamed", url="http://w:1", models=["m"]))
    assert [w.worker_id for w in registry.workers()] == ["renamed"]
    assert registry.record_report(wid, report(wid, 1)) is False  # unknown now: it must register again


def test_candidates_are_one_list_until_a_worker_changes_state_or_goes_stale_with_time():
    clock = Clock()
    registry, a = make(clock)
    registry.register(WorkerRegistration(worker_id="b", url="http://w:2", models=["m"]))
    registry.record_report(a, report(a, 1))
    registry.record_report("b", report("b", 1))
    first = registry.candidates("m")
    assert [w.worker_id for w in first] == ["a", "b"]
    clock.now += 0.5
    registry.record_report("b", report("b", 2))  # a report that changes no state keeps the list
    assert registry.candidates("m") is first
    assert [w.worker_id for w in registry.candidates("m", exclude={"a"})] == ["b"]
    clock.now += STALE_AFTER_S - 0.2  # a's last report is now too old; b's is not
    assert [w.worker_id for w in registry.candidates("m")] == ["b"]
    registry.record_report(a, report(a, 2))
    assert [w.worker_id for w in registry.candidates("m")] == ["a", "b"]
    for _ in range(CircuitBreaker.FAILURES_TO_OPEN):
        registry.record_failure(registry.get("b"), "500")
    assert [w.worker_id for w in registry.candidates("m")] == ["a"]
    clock.now += CircuitBreaker.BASE_COOLDOWN_S + 0.01  # half-open (reports keep both fresh)
    registry.record_report(a, report(a, 3))
    registry.record_report("b", report("b", 3))
    assert [w.worker_id for w in registry.candidates("m")] == ["a", "b"]
    registry.drain("a")
    assert [w.worker_id for w in registry.candidates("m")] == ["b"]
    registry.remove("b")
    assert registry.candidates("m") == []


def test_reports_resuming_after_a_silence_close_a_breaker_the_silence_opened_but_fresh_ones_do_not():
    clock = Clock()
    registry, wid = make(clock)
    registry.record_report(wid, report(wid, 1))
    worker = registry.get(wid)
    # A partition: requests to it time out and open its breaker, and its reports stop.
    for _ in range(CircuitBreaker.FAILURES_TO_OPEN):
        registry.record_failure(worker, "connect timeout")
    assert worker.state(clock()) is WorkerState.UNHEALTHY
    clock.now += STALE_AFTER_S + 0.5
    registry.record_report(wid, report(wid, 2))  # the link is back
    assert worker.state(clock()) is WorkerState.READY
    # While it keeps reporting, failures it causes itself still open the breaker.
    for _ in range(CircuitBreaker.FAILURES_TO_OPEN):
        registry.record_failure(worker, "connect refused")
    clock.now += 0.25
    registry.record_report(wid, report(wid, 3))
    assert worker.state(clock()) is WorkerState.UNHEALTHY


def test_workers_carry_their_role_and_an_encode_worker_never_takes_a_whole_request():
    clock = Clock()
    registry = Registry(clock=clock)
    for wid, role in (("p", "prefill"), ("d", "decode"), ("e", "encode")):
        registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}:1", models=["m"], role=role))
        registry.record_report(wid, report(wid, 1))
    assert {w.worker_id: w.to_json(clock())["role"] for w in registry.workers()} == {
        "p": "prefill", "d": "decode", "e": "encode"}
    assert {w.worker_id for w in registry.candidates("m")} == {"p", "d"}
