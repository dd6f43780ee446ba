"""The engine loop in-process: tokens arrive in order, and never earlier than the step-time model allows."""

from __future__ import annotations

import asyncio

import pytest

from backends.sim.cost import StepWork, step_time_s
from backends.sim.engine import SimEngine
from backends.sim.presets import get_preset
from backends.sim.scheduler import RequestStatus, SimRequest
from backends.sim.tokens import Prompt

pytestmark = pytest.mark.timeout(30)


async def test_tokens_are_never_delivered_before_their_simulated_step_ends():
    preset = get_preset("h100-qwen3-vl-8b")
    engine = SimEngine(preset, time_scale=20.0)
    engine.start()
    try:
        prompt_len, max_tokens = 4000, 20
        request = SimRequest("r", Prompt(list(range(prompt_len))), max_tokens)
        queue = engine.submit(request)
        texts = []
        while True:
            event = await asyncio.wait_for(queue.get(), 10)
            texts.append(event.text)
            if event.finished:
                break
    finally:
        await engine.stop()
    assert len(texts) == max_tokens and request.status == RequestStatus.FINISHED
    prefill = step_time_s(preset, StepWork(prefill_tokens=prompt_len, prefill_seqs=1, kv_tokens_read=prompt_len,
                                           attention_pairs=prompt_len * (prompt_len + 1) // 2))
    decode = step_time_s(preset, StepWork(decode_seqs=1, kv_tokens_read=prompt_len + 1, attention_pairs=prompt_len + 1))
    assert request.first_token_time - request.arrival_time >= prefill
    assert request.finish_time - request.first_token_time >= (max_tokens - 1) * decode
    assert engine.busy_sim_s == pytest.approx(prefill + (max_tokens - 1) * decode, rel=0.01)
    assert engine.kv.usage == 0.0


async def test_a_stalled_engine_produces_nothing_until_released():
    engine = SimEngine(get_preset("cpu-tiny"), time_scale=50.0)
    engine.start()
    try:
        engine.set_stalled(True)
        queue = engine.submit(SimRequest("r", Prompt([1, 2, 3]), 3))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queue.get(), 0.3)
        engine.set_stalled(False)
        assert (await asyncio.wait_for(queue.get(), 5)).text
    finally:
        await engine.stop()


async def test_a_burst_passes_the_api_front_end_one_request_at_a_time():
    """cpu-tiny models vLLM's API server: each request is tokenized before the engine sees it, in turn."""
    preset = get_preset("cpu-tiny")
    engine = SimEngine(preset, time_scale=1.0)  # real time: each request's front end spans several timer ticks
    engine.start()
    try:
        requests = [SimRequest(f"r{i}", Prompt(list(range(600 * i, 600 * i + 600))), 2) for i in range(4)]
        queues = [engine.submit(r) for r in requests]
        for queue in queues:
            while not (await asyncio.wait_for(queue.get(), 10)).finished:
                pass
        aborted = SimRequest("gone", Prompt(list(range(100))), 2)
        engine.submit(aborted)
        engine.abort(aborted)  # the client leaves while the front end has the request
        await asyncio.sleep(3 * preset.frontend_s / engine.time_scale)
    finally:
        await engine.stop()
    front_end = preset.frontend_s + preset.frontend_s_per_prompt_token * 600
    prefill = step_time_s(preset, StepWork(prefill_tokens=600, prefill_seqs=1, kv_tokens_read=600,
                                           attention_pairs=600 * 601 // 2))
    for k, request in enumerate(requests):
        assert request.first_token_time - request.arrival_time >= (k + 1) * front_end
    assert requests[0].first_token_time - requests[0].arrival_time >= front_end + prefill
    assert requests[0].first_token_time < requests[-1].first_token_time  # not all in one prefill step
    assert not engine.scheduler.has_work() and aborted.status == RequestStatus.ABORTED and engine.kv.usage == 0.0
