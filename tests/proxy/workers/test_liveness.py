"""Liveness from the engine's own progress, against a real proxy and real sim workers: a busy or slow engine is
never taken for dead, a frozen one still is (tests/proxy/dataplane/test_migration.py's SIGSTOP test), and the circuit
breaker opens on failures the engine causes, not on slowness (proxy/dataplane/stall.py, record.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from tests.e2e.test_forwarding import sse_events
from tests.support.fleet import FakeReports
from tests.support.procs import free_port, wait_until

pytestmark = pytest.mark.timeout(120)

STALL_WORDS = ("moving its requests", "looks stalled", "circuit opened")


def stall_lines(fleet) -> list[str]:
    """What the proxy logged about stalls and breakers."""
    return [line for line in fleet.proxy.log().splitlines() if any(w in line for w in STALL_WORDS)]


def metric_total(fleet, name: str) -> float:
    total = 0.0
    for line in fleet.http.get(fleet.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def words(n: int, word: str = "x") -> str:
    """A completions prompt of exactly `n` sim tokens (one per short word)."""
    return " ".join([word] * n)


async def stream(http: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[dict], list[float]]:
    """POST a streamed completion; (status, its JSON events, the gaps between the pieces that arrived)."""
    raw, arrivals = b"", []
    async with http.stream("POST", url, json=body | {"stream": True}) as resp:
        async for piece in resp.aiter_raw():
            raw += piece
            arrivals.append(time.monotonic())
    events = [orjson.loads(e) for e in sse_events(raw) if e != b"[DONE]"]
    return resp.status_code, events, [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def text_of(events: list[dict]) -> str:
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])


async def test_a_fleet_whose_every_engine_is_slow_serves_every_request(fleet):
    """Every engine busy and slow: a decode step every ~0.6 s and a prefill of ~1.5 s, longer than a stall_min_s
    of 0.5 s, so every stream is silent past it again and again; the engines' counters move and they answer."""
    fleet.start_proxy(config="proxy:\n  timeouts:\n    stall_min_s: 0.5\n")
    fleet.start_sims(2, time_scale=0.006)
    body = {"model": "m1", "max_tokens": 3, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        results = await asyncio.gather(*[stream(http, fleet.url + "/v1/completions", body | {
            "prompt": words(100, f"w{i}")}) for i in range(4)])
    assert [status for status, _, _ in results] == [200] * 4
    for _, events, _ in results:
        assert not any("error" in e for e in events), events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length" and len(text_of(events).split()) >= 3
    assert max(max(gaps) for _, _, gaps in results) > 0.5  # silent past stall_min_s: the case at hand
    assert stall_lines(fleet) == []
    assert metric_total(fleet, "kvroute:migrations_total") == 0 and metric_total(fleet, "kvroute:retries_total") == 0
    assert not any(w["stalled"] or w["breaker_open"] for w in fleet.workers())


async def test_a_stream_preempted_while_its_engine_works_for_others_is_not_stalled(fleet):
    """The proxy's stream is preempted by the engine (its KV is needed by an older request) and waits seconds in
    its queue, silent, while the engine generates for another client: its counters move, so it is alive."""
    fleet.start_proxy(config="proxy:\n  timeouts:\n    stall_min_s: 1.0\n")
    (sim,) = fleet.start_sims(1, time_scale=0.1, kv_capacity_tokens=256, extra=("--block-size", "16"))
    async with httpx.AsyncClient(timeout=60) as http:
        # an older request straight to the engine, that needs nearly all of its 16 blocks by its end
        older_started = asyncio.Event()

        async def older() -> tuple[int, list[dict], list[float]]:
            body = {"model": "m1", "prompt": words(150, "o"), "max_tokens": 100, "ignore_eos": True, "stream": True}
            raw = b""
            async with http.stream("POST", sim.url + "/v1/completions", json=body) as resp:
                async for piece in resp.aiter_raw():
                    raw += piece
                    if raw.count(b"\n\n") >= 3:
                        older_started.set()
            return resp.status_code, [orjson.loads(e) for e in sse_events(raw) if e != b"[DONE]"], []

        first = asyncio.create_task(older())
        await asyncio.wait_for(older_started.wait(), 30)
        ours = await stream(http, fleet.url + "/v1/completions",
                            {"model": "m1", "prompt": words(40, "p"), "max_tokens": 100, "ignore_eos": True})
        theirs = await first
        state = (await http.get(sim.url + "/sim/state")).json()
    status, events, gaps = ours
    assert status == 200 and theirs[0] == 200
    assert not any("error" in e for e in events), events[-1]
    assert len(text_of(events).split()) == 100
    assert state["num_preemptions"] >= 1
    assert max(gaps) > 1.5  # silent for longer than stall_min_s (with room): the case at hand
    assert stall_lines(fleet) == []
    assert metric_total(fleet, "kvroute:migrations_total") == 0


async def test_timeouts_on_a_busy_engine_do_not_open_its_breaker(fleet):
    """A first-byte timeout is slowness while the engine works for others: 504 to the client (it may still run),
    but no count against the worker (a frozen engine's timeouts do open it: tests/e2e/test_timeouts.py)."""
    fleet.start_proxy(config="proxy:\n  timeouts:\n    first_byte_s: 2.0\n")
    (sim,) = fleet.start_sims(1, time_scale=1.0, extra=("--max-num-seqs", "1"))
    async with httpx.AsyncClient(timeout=60) as http:
        # the engine's one slot, busy for a while with another client's long answer
        busy = asyncio.create_task(http.post(sim.url + "/v1/completions", json={
            "model": "m1", "prompt": "x", "max_tokens": 3000, "ignore_eos": True}))
        await asyncio.to_thread(wait_until, lambda: fleet.workers()[0]["last_report"]["num_running"] == 1, 20,
                                what="the engine busy")
        ours = await asyncio.gather(*[http.post(fleet.url + "/v1/completions", json={
            "model": "m1", "prompt": f"q{i}", "max_tokens": 4, "stream": True}) for i in range(3)])
        busy.cancel()
    assert [r.status_code for r in ours] == [504] * 3
    assert {r.json()["error"]["code"] for r in ours} == {"worker_timeout"}
    (worker,) = fleet.workers()
    assert not worker["breaker_open"] and not worker["stalled"], worker
    assert stall_lines(fleet) == []
    assert "was slow (first_byte_timeout), not failed" in fleet.proxy.log()


def test_5xx_and_refused_connections_open_the_breaker(fleet):
    """A worker that answers 500 where another serves the same request, and one that refuses connections, are at
    fault: their breakers open; the client gets every answer from the good worker."""
    fleet.start_proxy(config="proxy:\n  policy: round_robin\n")
    fleet.start_sims(1, prefix="good")
    fleet.start_sims(1, prefix="failing", extra=("--fail-rate", "1.0"))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fleet.register("dead-0", dead)
    with FakeReports(fleet, {"dead-0": (dead, 0.0)}):
        fleet.wait_workers(lambda ws: sum(w["state"] == "ready" for w in ws) == 3, what="3 workers ready")
        responses = [fleet.chat(f"q{i}") for i in range(12)]
    assert [r.status_code for r in responses] == [200] * 12, [r.text for r in responses if r.status_code != 200]
    assert {r.headers["x-kvroute-worker"] for r in responses} == {"good-0"}
    opened = " ".join(line for line in stall_lines(fleet) if "circuit opened" in line)
    assert "circuit opened for failing-0" in opened and "circuit opened for dead-0" in opened
    assert "good-0" not in opened


# --- the pieces, without processes ----------------------------------------------------------------------
def _vllm_text(prompt: float, generated: float, preempted: float, usage: float = 0.5, waiting: int = 0) -> str:
    labels = '{engine="0",model_name="tiny"}'
    return (f"vllm:kv_cache_usage_perc{labels} {usage}\nvllm:num_requests_running{labels} 4\n"
            f"vllm:num_requests_waiting{labels} {waiting}\nvllm:prompt_tokens_total{labels} {prompt}\n"
            f"vllm:generation_tokens_total{labels} {generated}\nvllm:num_preemptions_total{labels} {preempted}\n")


def test_work_counters_or_kv_usage_moving_is_progress_and_a_queue_growing_is_not():
    from proxy.workers.engine_metrics import parse_engine_metrics
    from proxy.workers.loadview import WorkerLoad

    load = WorkerLoad(capacity_tokens=1000)
    load.record_reading(parse_engine_metrics(_vllm_text(100, 50, 0)), now=10.0, source="metrics")
    assert load.progress_at is None  # a first reading has nothing to compare with
    load.record_reading(parse_engine_metrics(_vllm_text(100, 50, 0, waiting=5)), now=11.0, source="metrics")
    assert load.progress_at is None and not load.progressed_since(0.0)  # arrivals are no work done
    load.record_reading(parse_engine_metrics(_vllm_text(100, 51, 0, waiting=5)), now=12.0, source="metrics")
    assert load.progress_at == 12.0 and load.progressed_since(11.5) and not load.progressed_since(12.0)
    load.record_reading(parse_engine_metrics(_vllm_text(100, 51, 0, usage=0.6)), now=13.0, source="metrics")
    assert load.progress_at == 13.0  # a prefill chunk took blocks before any counter moved


def test_the_vllm_adapter_and_the_sim_report_the_engines_work_counters():
    from backends.engines.vllm import VllmAdapter
    from backends.sim.presets import get_preset
    from backends.sim.server import SimServer

    load = VllmAdapter().load_from_metrics(_vllm_text(1200, 340, 2))
    assert (load.prompt_tokens_total, load.generation_tokens_total, load.preemptions_total) == (1200, 340, 2)
    server = SimServer(get_preset("cpu-tiny"), "m")
    server.engine.scheduler.num_generated_tokens = 7
    sim_load = asyncio.run(server.load_reading())
    assert (sim_load.prompt_tokens_total, sim_load.generation_tokens_total, sim_load.preemptions_total) == (0, 7, 0)


def test_a_probe_that_shows_the_engine_moved_takes_a_stalled_worker_back_and_one_that_does_not_leaves_it():
    from proxy.protocol import LoadReport, WorkerRegistration
    from proxy.workers.engine_metrics import parse_engine_metrics
    from proxy.workers.registry import Registry, WorkerState

    registry = Registry(clock=lambda: 50.0)
    worker = registry.register(WorkerRegistration(worker_id="a", url="http://a:1", models=["m"]))
    registry.record_report("a", LoadReport(worker_id="a", url="http://a:1", models=["m"], kv_cache_usage=0.5,
                                           kv_capacity_tokens=1000, num_running=4, num_waiting=0, seq=1,
                                           prompt_tokens_total=100, generation_tokens_total=50, preemptions_total=0))
    registry.mark_stalled(worker, "stalled: test")
    registry.record_probe_reading(worker, parse_engine_metrics(_vllm_text(100, 50, 0)))
    assert worker.state(50.0) is WorkerState.UNHEALTHY and worker.load.reading_source == "report"
    registry.record_probe_reading(worker, parse_engine_metrics(_vllm_text(100, 53, 0)))
    assert worker.state(50.0) is WorkerState.READY and worker.load.progress_at == 50.0


def test_failures_of_requests_sent_before_a_breaker_opened_do_not_lengthen_its_cooldown():
    from proxy.workers.registry import BreakerState, CircuitBreaker

    breaker, now = CircuitBreaker(), 10.0
    for _ in range(CircuitBreaker.FAILURES_TO_OPEN):
        breaker.record_failure(now)
    assert breaker.state(now) is BreakerState.OPEN and breaker.open_until == now + CircuitBreaker.BASE_COOLDOWN_S
    for _ in range(20):  # the rest of what it held fails with the same outage
        assert not breaker.record_failure(now + 0.1)
    assert breaker.open_until == now + CircuitBreaker.BASE_COOLDOWN_S
    assert breaker.record_failure(now + CircuitBreaker.BASE_COOLDOWN_S)  # a failed trial after the cooldown
    assert breaker.cooldown_s == CircuitBreaker.BASE_COOLDOWN_S * 4


def test_a_timeout_counts_against_a_worker_only_when_its_engine_stood_still_meanwhile():
    from proxy.config import Timeouts
    from proxy.dataplane.record import Recorder
    from proxy.workers.registry import Registry

    now = [1000.0]
    registry = Registry(clock=lambda: now[0])
    from proxy.protocol import WorkerRegistration
    worker = registry.register(WorkerRegistration(worker_id="a", url="http://a:1", models=["m"]))
    recorder = Recorder(registry, None, lambda: Timeouts(first_byte_s=10.0, idle_s=5.0))  # type: ignore[arg-type]
    assert recorder.engine_failed(worker, "first_byte_timeout")  # never seen to move
    worker.load.progress_at = 992.0
    assert not recorder.engine_failed(worker, "first_byte_timeout")  # moved during the 10 s wait: slow
    assert recorder.engine_failed(worker, "idle_timeout")  # not during the last 5 s of silence
    assert recorder.engine_failed(worker, "connect_error")  # refused or reset: the engine's, however busy


async def test_the_threshold_follows_the_engines_step_times_and_what_it_holds():
    from proxy.config import Timeouts
    from proxy.dataplane.stall import SLACK, StallWatch
    from proxy.protocol import WorkerRegistration
    from proxy.workers.registry import Registry

    class Steps:
        decode_step_s, s_per_token = 0.05, 1e-4

    registry = Registry()
    worker = registry.register(WorkerRegistration(worker_id="a", url="http://a:1", models=["m"]))
    worker.load.step_tokens = 2048
    timeouts = Timeouts(stall_min_s=0.5, idle_s=60.0)

    async def never(_worker, _timeout):
        return True

    pulse = StallWatch(registry, lambda: timeouts, lambda _id: Steps(), never).pulse(worker)
    assert pulse.threshold() == pytest.approx(SLACK * (0.05 + 2048 * 1e-4))  # one step with a full prefill chunk
    worker.load.start_request(30_000, now=0.0, prefill_tokens=20_000)  # a long prompt sent there, no output yet
    assert pulse.threshold() == pytest.approx(SLACK * (0.05 + 20_000 * 1e-4))
    for _ in range(50):
        pulse.observe_gap(30.0)  # streams measured far slower than the estimator thinks
    assert pulse.threshold() == timeouts.idle_s  # at most idle_s: each exchange's own deadline then comes first
