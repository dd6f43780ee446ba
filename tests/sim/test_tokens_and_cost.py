"""Token estimates (text, Qwen3-VL images) and the step-time model."""

from __future__ import annotations

import pytest

from backends.sim.cost import StepWork, step_time_s
from backends.sim.presets import get_preset
from backends.sim.tokens import (
    IMAGE_PAD,
    FillerText,
    chat_prompt,
    count_text_tokens,
    image_tokens_for_size,
    public_token_ids,
    text_token_ids,
)
from tests.sim.conftest import png_data_url


def test_text_estimate_is_deterministic_and_prefix_stable():
    text = ("The quick brown fox jumps over the lazy dog. " * 20).rstrip()
    assert text_token_ids(text) == text_token_ids(text)
    assert text_token_ids(text + " More words here")[: len(text_token_ids(text))] == text_token_ids(text)
    words = len(text.split())
    assert 1.0 <= count_text_tokens(text) / words <= 1.6  # near Qwen's BPE on English prose


def test_remembered_prompts_give_the_same_ids_and_callers_cannot_change_them():
    """Long texts and images are tokenized once per sim (tokens.py): what a caller does with the ids it got
    must not change what the next request with the same text or image gets."""
    system = "You answer questions about the fleet. " * 40  # long enough to be remembered
    image = png_data_url(320, 320, color=(9, 9, 9))
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "what is it?"}]}]
    first = chat_prompt(msgs)
    first.token_ids.clear()
    ids = text_token_ids(system)
    ids.append(7)
    again = chat_prompt(msgs)
    assert again.token_ids == chat_prompt(msgs).token_ids and len(again.token_ids) > 400
    assert text_token_ids(system) == ids[:-1]
    assert again.num_media_tokens == 100


@pytest.mark.parametrize(("size", "tokens"), [
    ((1024, 1024), 1024),  # 32x32 px per token
    ((640, 480), 300),  # 20 x 15
    ((64, 64), 64),  # raised to min_pixels 65536 = 64 tokens
    ((8192, 8192), 16384),  # capped at max_pixels 16777216
])
def test_qwen3_vl_image_rule(size, tokens):
    assert image_tokens_for_size(*size) == tokens


def test_image_size_comes_from_the_data_url_and_repeats_give_equal_ids():
    msg = lambda url: [{"role": "user", "content": [  # noqa: E731
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe"}]}]
    small = chat_prompt(msg(png_data_url(320, 320)))
    large = chat_prompt(msg(png_data_url(640, 640)))
    assert small.num_media_tokens == 100 and large.num_media_tokens == 400
    again = chat_prompt(msg(png_data_url(320, 320)))
    other = chat_prompt(msg(png_data_url(320, 320, color=(0, 0, 255))))
    assert again.token_ids == small.token_ids
    assert other.token_ids != small.token_ids  # same size, different pixels: different cache key
    assert public_token_ids(small.token_ids).count(IMAGE_PAD) == 100
    url_only = chat_prompt(msg("https://example.com/cat.jpg"))
    assert url_only.num_media_tokens == image_tokens_for_size(1280, 720)


def test_filler_text_costs_one_token_per_generated_token():
    filler = FillerText(seed=3)
    text = "".join(filler.next_piece(first=i == 0)[0] for i in range(50))
    assert count_text_tokens(text) == 50


def test_step_time_follows_the_roofline():
    h100 = get_preset("h100-qwen3-vl-8b")
    one_decode = step_time_s(h100, StepWork(decode_seqs=1, kv_tokens_read=1000))
    # decode is memory bound: weights (17.6 GB) over 0.8 x 3.35 TB/s, plus 2 ms overhead
    assert one_decode == pytest.approx(0.002 + 20e-6 + (17.56e9 + 1000 * 147456) / (3.35e12 * 0.8), rel=1e-3)
    batch = step_time_s(h100, StepWork(decode_seqs=64, kv_tokens_read=64 * 2000))
    assert one_decode < batch < 64 * one_decode  # batching amortises the weights
    prefill = step_time_s(h100, StepWork(prefill_tokens=4000, prefill_seqs=1, kv_tokens_read=4000,
                                          attention_pairs=4000 * 4001 // 2))
    assert prefill > 2 * 8.2e9 * 4000 / (989e12 * 0.5)  # compute bound: at least the GEMM FLOPs
    with_image = step_time_s(h100, StepWork(prefill_tokens=4000, prefill_seqs=1, kv_tokens_read=4000,
                                            attention_pairs=4000 * 4001 // 2, image_tokens=4000))
    assert with_image > prefill  # the vision encoder costs extra


def test_cpu_tiny_matches_the_measured_vllm_cpu_worker():
    """Bounds from vLLM's own /metrics on the tiny model (bench/sim_vs_vllm_cpu.py, presets.py docstring):
    mean inter-token gap 4.0-4.3 ms alone and 5.5 ms among 8 streams (prefill steps included), a
    ~270-token prompt's prefill 15 ms, a ~1300-token one 53 ms."""
    tiny = get_preset("cpu-tiny")

    def decode(seqs: int) -> float:
        return step_time_s(tiny, StepWork(decode_seqs=seqs, kv_tokens_read=seqs * 200))

    def prefill(tokens: int) -> float:
        return step_time_s(tiny, StepWork(prefill_tokens=tokens, prefill_seqs=1, kv_tokens_read=tokens,
                                          attention_pairs=tokens * (tokens + 1) // 2))

    assert 0.0035 <= decode(1) <= 0.0045
    assert 0.0045 <= decode(8) <= 0.006
    assert 0.012 <= prefill(270) <= 0.019
    assert 0.04 <= prefill(1300) <= 0.07
