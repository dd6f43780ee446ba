"""kv_cost's predicted time to first token against the sim engine's measured one, on a known preset.

The sim's scheduler and step-time model run here step by step in simulated time (no clock, no
sleeps); the proxy-side model sees only what a worker reports (KV usage, running, waiting, its
prefill rate and decode step) and learns from measured TTFTs as the proxy does.
Stated error: idle worker within 15% (+2 ms); with a decoding batch within 35%; a worker whose
KV is full and whose queue waits within a factor of 2 (the wait depends on when requests it
cannot see finish).
"""

from __future__ import annotations

import random

from backends.sim.cost import step_time_s
from backends.sim.kvcache import KVCache
from backends.sim.presets import get_preset
from backends.sim.scheduler import Scheduler, SimRequest
from backends.sim.speed import StepSpeed
from backends.sim.tokens import completion_prompt
from proxy.request import RoutedRequest
from proxy.routing.estimator import WorkerModel
from proxy.routing.kv_cost import predict
from proxy.workers.loadview import EngineReading
from proxy.workers.registry import Worker

PRESET = "h100-qwen3-vl-8b"


class SimDriver:
    """One sim engine advanced a step at a time in simulated seconds."""

    def __init__(self, kv_capacity_tokens: int | None = None) -> None:
        preset = get_preset(PRESET)
        if kv_capacity_tokens:
            preset = preset.with_overrides(kv_capacity_tokens=kv_capacity_tokens)
        self.preset = preset
        self.kv = KVCache(preset.kv_capacity_tokens // preset.block_size, preset.block_size)
        self.sched = Scheduler(self.kv, preset.max_num_seqs, preset.max_num_batched_tokens)
        self.speed = StepSpeed()
        self.now = 0.0
        self._ids = 0

    def submit(self, tokens: list[int], max_tokens: int) -> SimRequest:
        self._ids += 1
        request = SimRequest(f"r{self._ids}", completion_prompt(tokens), max_tokens, arrival_time=self.now)
        self.sched.add(request)
        return request

    def step(self) -> None:
        step = self.sched.schedule()
        assert step.scheduled, "nothing to run"
        duration = step_time_s(self.preset, step.work)
        self.now += duration
        self.speed.observe(step.work, duration)
        self.sched.update(step, now=self.now)

    def run_until_first_token(self, request: SimRequest) -> float:
        while request.first_token_time is None:
            self.step()
        return request.first_token_time - request.arrival_time

    def report_to(self, worker: Worker, model: WorkerModel) -> None:
        """What the worker's reporter would send now."""
        capacity = self.kv.num_blocks * self.kv.block_size
        worker.load.record_reading(EngineReading(self.kv.usage, len(self.sched.running), len(self.sched.waiting),
                                                 capacity), self.now, "report")
        model.observe_report(self.speed.prefill_tokens_per_s, self.speed.decode_step_s)


def routed(prompt_tokens: int, output_tokens: int) -> RoutedRequest:
    return RoutedRequest(body=b"", payload={}, kind="completions", model="m", stream=True, prefix_hashes=[],
                         prefix_tokens=[], prompt_tokens=prompt_tokens, expected_output_tokens=output_tokens)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def learnt_worker(rng: random.Random, sim: SimDriver) -> tuple[Worker, WorkerModel]:
    """A worker model trained as the proxy would: reports, plus 30 measured TTFTs on the idle engine."""
    worker = Worker("w", "http://w", ["m"], capacity_tokens=sim.preset.kv_capacity_tokens)
    model = WorkerModel()
    for _ in range(30):
        n = rng.randrange(100, 6000)
        sim.report_to(worker, model)
        pred = predict(worker, model, routed(n, 1), 0, 0, sim.now)
        request = sim.submit(tokens(rng, n), 1)
        measured = sim.run_until_first_token(request)
        model.observe_prefill(n, 0, measured - pred.queue_s)
    return worker, model


def test_idle_worker_prefill_predictions_are_within_15_percent_of_the_sim():
    rng = random.Random(7)
    sim = SimDriver()
    worker, model = learnt_worker(rng, sim)
    shared = tokens(rng, 3000)
    sim.run_until_first_token(sim.submit(shared + tokens(rng, 10), 1))  # leaves `shared` in its prefix cache
    for n, cached in [(200, 0), (1500, 0), (5000, 0), (3400, 2992), (3200, 2992)]:
        sim.report_to(worker, model)
        pred = predict(worker, model, routed(n, 1), cached, 0, sim.now)
        prompt = (shared[:cached] if cached else []) + tokens(rng, n - cached)
        measured = sim.run_until_first_token(sim.submit(prompt, 1))
        assert abs(pred.ttft_s - measured) <= 0.15 * measured + 0.002, (n, cached, pred.ttft_s, measured)


def test_predictions_with_a_decoding_batch_are_within_35_percent():
    rng = random.Random(8)
    sim = SimDriver()
    worker, model = learnt_worker(rng, sim)
    for _ in range(48):  # a batch that keeps decoding while the new prompt arrives
        sim.submit(tokens(rng, rng.randrange(500, 2000)), 2000)
    for _ in range(20):
        sim.step()
    for n in (300, 2000, 6000):
        sim.report_to(worker, model)
        pred = predict(worker, model, routed(n, 1), 0, 0, sim.now)
        measured = sim.run_until_first_token(sim.submit(tokens(rng, n), 1))
        assert abs(pred.ttft_s - measured) <= 0.35 * measured, (n, pred.ttft_s, measured)


def test_a_full_worker_with_a_waiting_queue_is_predicted_within_a_factor_of_2():
    rng = random.Random(9)
    sim = SimDriver(kv_capacity_tokens=32768)
    worker, model = learnt_worker(rng, sim)
    output = 300
    for _ in range(40):  # ~1300 tokens each at the peak: 40 of them need ~1.6x the cache
        sim.submit(tokens(rng, 1000), output)
    for _ in range(60):
        sim.step()
    assert sim.sched.waiting and sim.kv.usage > 0.8
    sim.report_to(worker, model)
    model.observe_turnover(output * (sim.speed.decode_step_s or 0.0))  # as the proxy measures it on streams
    pred = predict(worker, model, routed(1000, output), 0, 0, sim.now)
    measured = sim.run_until_first_token(sim.submit(tokens(rng, 1000), output))
    assert pred.queue_s > 0
    assert measured / 2 <= pred.ttft_s <= measured * 2, (pred.queue_s, pred.ttft_s, measured)


def test_the_sim_reports_its_marginal_prefill_rate_and_decode_step():
    rng = random.Random(10)
    sim = SimDriver()
    learnt_worker(rng, sim)
    for _ in range(8):
        sim.submit(tokens(rng, 500), 50)
    for _ in range(30):
        sim.step()
    # roofline of the preset: 2 x 8.2 G params per token at 0.5 x 989 TFLOP/s = 30k tokens/s, less attention
    assert 20_000 < sim.speed.prefill_tokens_per_s < 31_000
    assert 0.005 < sim.speed.decode_step_s < 0.02
