"""The sim worker's OpenAI surface, as a real process, read with the official `openai` client."""

from __future__ import annotations

import time

import httpx
import openai
import orjson
import pytest

from backends.sim.kvcache import block_hashes
from backends.sim.tokens import chat_prompt
from tests.sim.conftest import png_data_url, read_metrics

pytestmark = pytest.mark.timeout(60)

MODEL = "qwen3-vl-tiny"


@pytest.fixture
def worker(sim):
    _, url = sim("--preset", "cpu-tiny", "--time-scale", "20", "--served-model-name", MODEL)
    return url


def test_streamed_and_plain_answers_parse_with_the_openai_client(worker):
    client = openai.OpenAI(base_url=f"{worker}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something about routing requests."}]
    prompt_tokens = httpx.post(f"{worker}/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]

    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert plain.choices[0].finish_reason == "length"
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].message.content
    assert plain.usage.completion_tokens == 12 and plain.usage.prompt_tokens == prompt_tokens
    completion_text_tokens = httpx.post(f"{worker}/tokenize", json={"prompt": plain.choices[0].message.content})
    assert completion_text_tokens.json()["count"] == 12  # usage agrees with the engine's own estimate

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=7, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content and finishes == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)

    continuous = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # vLLM's extension
    assert [c.usage.completion_tokens for c in continuous if c.choices and c.choices[0].delta.content] == [1, 2, 3, 4]

    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True,
                                              stream_options={"include_usage": True}))
    assert sum(1 for c in streamed if c.choices and c.choices[0].text) == 5
    assert streamed[-1].usage.total_tokens == streamed[-1].usage.prompt_tokens + 5

    without_limit = client.chat.completions.create(model=MODEL, messages=messages,
                                                   extra_body={"ignore_eos": True})
    assert without_limit.choices[0].finish_reason == "stop" and without_limit.usage.completion_tokens >= 1

    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 4096 and models[0].owned_by


def test_errors_use_the_openai_error_body(worker):
    client = openai.OpenAI(base_url=f"{worker}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert "does not exist" in missing.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
    assert "maximum context length is 4096" in too_long.value.body["message"]
    bad = httpx.post(f"{worker}/v1/chat/completions", content=b"{not json", timeout=5)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    bad_image = httpx.post(f"{worker}/v1/chat/completions", timeout=5, json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert bad_image.status_code == 400


def test_health_tokenize_and_metrics_names(worker):
    assert httpx.get(f"{worker}/health").status_code == 200
    image_msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(640, 480)}},
                                              {"type": "text", "text": "what is this?"}]}]
    tokenized = httpx.post(f"{worker}/tokenize", json={"model": MODEL, "messages": image_msg}).json()
    assert tokenized["tokens"].count(151655) == 300  # 640x480 / (32x32)
    assert tokenized["max_model_len"] == 4096
    metrics = read_metrics(worker)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:cache_config_info", "kvroute:sim_lag_seconds_total", "kvroute:sim_busy_seconds_total"):
        assert name in metrics, name
    text = httpx.get(f"{worker}/metrics").text
    assert 'num_gpu_blocks="32"' in text and 'block_size="128"' in text
    assert 'model_name="qwen3-vl-tiny"' in text and 'engine="0"' in text


def test_the_state_feed_mirrors_the_prefix_cache_in_hashes_made_in_another_process(worker):
    # bench/oracle.py keeps a copy of each sim's prefix cache from GET /sim/feed and hashes prompts in its own
    # process: the copy must hold the served prompt's blocks under the same hashes, the queues must be empty
    # again once the request is done, and nothing else may be in the copy
    messages = [{"role": "user", "content": "A long system prompt that many requests share. " * 30}]
    ids = chat_prompt(messages).token_ids
    mirror: set[int] = set()
    with httpx.stream("GET", f"{worker}/sim/feed", timeout=10) as feed:
        lines = feed.iter_lines()
        first = orjson.loads(next(lines))
        assert first["reset"] and first["model"] == MODEL and first["added"] == [] and first["enqueued"] == 0
        bs = first["queues"]["block_size"]
        wanted = block_hashes(ids, bs, (len(ids) - 1) // bs)
        assert wanted
        served = httpx.post(f"{worker}/v1/chat/completions", timeout=30,
                            json={"model": MODEL, "messages": messages, "max_tokens": 2})
        assert served.status_code == 200
        deadline = time.monotonic() + 20
        while True:
            line = orjson.loads(next(lines))
            mirror.update(line["added"])
            mirror.difference_update(line["removed"])
            if line["enqueued"] == 1 and not line["queues"]["running"] and not line["queues"]["waiting"]:
                break
            assert time.monotonic() < deadline, line
    assert set(wanted) <= mirror
    assert len(mirror) <= (len(ids) + 2) // bs  # the full blocks of the prompt and its 2 tokens, nothing more
    other = chat_prompt([{"role": "user", "content": "Nothing like it was ever sent here. " * 30}]).token_ids
    assert not set(block_hashes(other, bs)) & mirror
