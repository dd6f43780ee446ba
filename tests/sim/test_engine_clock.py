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
