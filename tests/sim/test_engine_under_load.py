"""Engine behaviour a router depends on, seen through a real sim worker's HTTP and /metrics."""

from __future__ import annotations

import asyncio
import random
import string

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.presets import get_preset
from backends.sim.scheduler import SimRequest
from backends.sim.server import SimServer
from backends.sim.tokens import chat_prompt
from tests.sim.conftest import png_data_url, read_metrics, read_state
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(90)


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(count))


def _ttft_of_next_request(url: str, client: openai.OpenAI, messages: list) -> tuple[float, int]:
    """(simulated TTFT from /metrics, cached prompt tokens from usage) of one request."""
    before = read_metrics(url)["vllm:time_to_first_token_seconds_sum"]
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    after = read_metrics(url)["vllm:time_to_first_token_seconds_sum"]
    details = answer.usage.prompt_tokens_details
    return after - before, (details.cached_tokens or 0) if details else 0


def test_a_repeated_long_prompt_and_a_repeated_image_hit_the_prefix_cache_and_start_sooner(sim):
    # half speed: a host hiccup of h wall seconds shifts simulated TTFT by only h / 2
    _, url = sim("--preset", "h100-qwen3-vl-8b", "--served-model-name", "m", "--time-scale", "0.5")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    document = words(6000, seed=1)

    first_ttft, first_cached = _ttft_of_next_request(url, client, [{"role": "user", "content": document + " Q1?"}])
    second_ttft, second_cached = _ttft_of_next_request(url, client, [{"role": "user", "content": document + " Q2?"}])
    assert first_cached == 0 and second_cached > 5000
    assert second_ttft < first_ttft / 2

    image = png_data_url(2048, 2048)  # 4096 image tokens

    def with_image(question: str) -> list:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": question}]}]

    first_ttft, first_cached = _ttft_of_next_request(url, client, with_image("What is in this picture?"))
    second_ttft, second_cached = _ttft_of_next_request(url, client, with_image("Which colour is it?"))
    assert first_cached == 0 and second_cached >= 4000
    assert second_ttft < first_ttft / 2
    metrics = read_metrics(url)
    assert metrics["vllm:prefix_cache_hits_total"] >= second_cached + 5000


async def test_a_burst_beyond_capacity_fills_the_cache_queues_and_drains_to_zero(sim):
    _, url = sim("--preset", "cpu-tiny", "--kv-capacity-tokens", "4096", "--max-num-seqs", "8",
                 "--served-model-name", "m", "--time-scale", "4")
    samples: list[dict[str, float]] = []
    done = asyncio.Event()

    async with httpx.AsyncClient(timeout=60) as client:
        async def sample_metrics() -> None:
            while not done.is_set():
                samples.append(read_metrics_from(await client.get(f"{url}/metrics")))
                await asyncio.sleep(0.02)

        async def one(i: int) -> dict:
            body = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": words(350, seed=i)}]}
            response = await client.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.json()

        sampler = asyncio.create_task(sample_metrics())
        answers = await asyncio.gather(*(one(i) for i in range(32)))
        done.set()
        await sampler

    assert all(a["usage"]["completion_tokens"] == 200 for a in answers)
    assert max(s["vllm:kv_cache_usage_perc"] for s in samples) > 0.5
    assert max(s["vllm:num_requests_waiting"] for s in samples) > 0
    assert max(s["vllm:num_requests_running"] for s in samples) <= 8
    after = wait_until(lambda: (m := read_metrics(url))["vllm:kv_cache_usage_perc"] == 0.0 and m, 10,
                       what="KV usage back to 0")
    state = read_state(url)
    assert after["vllm:num_requests_running"] == state["num_running"] == 0
    assert after["vllm:num_requests_waiting"] == state["num_waiting"] == 0
    assert after["vllm:num_preemptions_total"] == state["num_preemptions"] > 0  # 32 blocks cannot hold 8 x 560 tokens
    assert after["vllm:prefix_cache_queries_total"] == state["prefix_cache_queries"]
    assert after["vllm:prefix_cache_hits_total"] == state["prefix_cache_hits"]
    assert after["vllm:request_success_total"] == state["num_finished"] == 32
    assert after["vllm:e2e_request_latency_seconds_count"] == 32


def read_metrics_from(response: httpx.Response) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(response.text) for s in f.samples
            if not s.name.endswith("_bucket")}


async def test_metrics_agree_with_engine_state_at_every_step():
    """In-process: the engine is stepped by hand and /metrics is rendered after every step."""
    # no front-end delay: it runs on the engine's loop, and this test steps the scheduler by hand
    preset = get_preset("cpu-tiny").with_overrides(kv_capacity_tokens=1024, max_num_seqs=4,
                                                   frontend_s=0.0, frontend_s_per_prompt_token=0.0)
    server = SimServer(preset, "m")
    engine = server.engine
    rng = random.Random(7)
    for i in range(12):
        prompt = chat_prompt([{"role": "user", "content": words(rng.randint(20, 200), seed=i % 2)}])
        engine.submit(SimRequest(f"r{i}", prompt, rng.randint(1, 300)))
    steps = 0
    while engine.scheduler.has_work():
        step = engine.scheduler.schedule()
        for event in engine.scheduler.update(step, now=float(steps)):
            if event.finished:
                server.metrics.observe_finished(event.request)
        steps += 1
        m = read_metrics_from(httpx.Response(200, content=server.metrics.render()))
        sched = engine.scheduler
        assert m["vllm:kv_cache_usage_perc"] == engine.kv.num_used_blocks / engine.kv.num_blocks
        assert m["vllm:num_requests_running"] == len(sched.running)
        assert m["vllm:num_requests_waiting"] == len(sched.waiting)
        assert m["vllm:num_preemptions_total"] == sched.num_preemptions
        assert m["vllm:prefix_cache_queries_total"] == sched.prefix_queries_tokens
        assert m["vllm:prefix_cache_hits_total"] == sched.prefix_hit_tokens
        assert m["vllm:request_success_total"] == m["vllm:e2e_request_latency_seconds_count"] == sched.num_finished
    assert steps > 10 and engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_hit_tokens > 0


def test_a_client_that_disconnects_frees_its_blocks(sim):
    _, url = sim("--preset", "cpu-tiny", "--served-model-name", "m", "--time-scale", "1")
    body = {"model": "m", "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": words(50, 3)}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert read_state(url)["num_running"] == 1
    wait_until(lambda: (s := read_state(url))["num_running"] == 0 and s["used_blocks"] == 0, 10,
               what="the aborted stream to free its blocks")

    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    wait_until(lambda: (s := read_state(url))["num_running"] == 0 and s["used_blocks"] == 0, 10,
               what="the abandoned request to free its blocks")
