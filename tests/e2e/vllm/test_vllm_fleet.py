"""End to end on real vLLM CPU engines: two `kvroute worker --engine vllm` behind `kvroute proxy`.

The tiny Qwen3-VL answers noise, so these check what a client can rely on: shapes, token
counts (images really go through the vision path: each adds its placeholder tokens), streaming
usage, load reports that move under load, and failover when one engine dies. The workers start
once per module (~30 s each); the failover test runs last because it kills one of them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, AuthenticationError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from proxy.routing.cached_prefix import RECENT_S
from proxy.tokens.bundle import read_model_dir
from proxy.tokens.counter import PromptCounter
from tests.support.procs import (
    KVROUTE,
    REPO,
    Proc,
    ProcessGroup,
    admin_headers,
    free_port,
    wait_http_ok,
    wait_until,
)

pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(420),
]

MODEL_DIR = REPO / "models" / "tiny-qwen3-vl"
MODEL = "tiny"
# An operator-given engine key (the worker keeps it instead of a random one) so this test may call
# an engine directly, as only the proxy could otherwise.
ENGINE_KEY = "e2e-engine-key"
# 8 MiB of KV = 4096 tokens (32 blocks of 128) on the tiny model: a few long requests fill it.
ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(8 * 1024 * 1024), "--max-num-seqs", "16",
               "--max-model-len", "2048"]
WORKER_START_TIMEOUT_S = 240


@dataclass
class Fleet:
    proxy_url: str
    workers: dict[str, tuple[Proc, int]]  # worker_id -> (supervisor, engine port)
    group: ProcessGroup

    def workers_view(self) -> dict[str, dict]:
        body = httpx.get(f"{self.proxy_url}/workers", timeout=5).json()
        return {w["worker_id"]: w for w in body["workers"]}


def png_data_url(width: int, height: int, color: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def engine_pid(port: int) -> int | None:
    """The vLLM API server listening on `port` (the supervisor's grandchild, under the guard)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"vllm.entrypoints.openai.api_server"] and str(port).encode() in argv:
            return int(entry.name)
    return None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("vllm-fleet")
    group = ProcessGroup(log_dir)
    try:
        if not (MODEL_DIR / "config.json").exists():
            build = group.start([*KVROUTE, "make-tiny-model", str(MODEL_DIR)], name="make-tiny-model")
            assert build.popen.wait(180) == 0, build.log()
        proxy_port = free_port()
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        group.start([*KVROUTE, "proxy", "--port", str(proxy_port)], name="proxy")
        wait_http_ok(f"{proxy_url}/health", timeout=30)
        workers: dict[str, tuple[Proc, int]] = {}
        for worker_id in ("vllm-a", "vllm-b"):
            port = free_port()
            proc = group.start(
                [*KVROUTE, "worker", "--engine", "vllm", "--model", str(MODEL_DIR), "--device", "cpu",
                 "--served-model-name", MODEL, "--port", str(port), "--worker-id", worker_id,
                 "--proxy-url", proxy_url, "--drain-grace-s", "60", "--", *ENGINE_ARGS],
                name=worker_id, env={"KVROUTE_LOG_DIR": str(log_dir), "VLLM_API_KEY": ENGINE_KEY,
                                     "VLLM_SERVER_DEV_MODE": "1"})  # POST /reset_prefix_cache
            workers[worker_id] = (proc, port)
        fleet = Fleet(proxy_url, workers, group)

        def both_ready() -> bool:
            for proc, _ in workers.values():
                assert proc.alive(), f"worker exited early:\n{proc.log()[-4000:]}"
            view = fleet.workers_view()
            return all(view.get(w, {}).get("state") == "ready" for w in workers)

        wait_until(both_ready, WORKER_START_TIMEOUT_S, 0.5, "both vLLM workers to register ready")
        yield fleet
    except Exception:
        print(group.logs())
        raise
    finally:
        group.stop_all()


def client(fleet: Fleet) -> OpenAI:
    return OpenAI(base_url=f"{fleet.proxy_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(fleet: Fleet, content, max_tokens: int = 6):
    return client(fleet).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        extra_body={"ignore_eos": True})


def test_workers_register_as_vllm_with_their_kv_capacity(fleet):
    view = fleet.workers_view()
    for worker_id, (_, port) in fleet.workers.items():
        assert view[worker_id]["engine"] == "vllm"
        assert view[worker_id]["url"].endswith(f":{port}")
        assert view[worker_id]["kv_capacity_tokens"] == 4096  # 32 blocks x 128 from vLLM's cache_config_info
        assert view[worker_id]["max_model_len"] == 2048


def test_each_workers_engine_cache_reaches_the_proxy_through_its_kv_events(fleet):
    raw = chat(fleet, " ".join(f"harbour{i} at dawn" for i in range(120)), max_tokens=2)  # ~5 blocks of 128
    served = raw.headers["x-kvroute-worker"]

    def kv_view() -> dict[str, float]:
        text = httpx.get(f"{fleet.proxy_url}/metrics", timeout=5).text
        return {sample.labels.get("state", "blocks"): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name in ("kvroute:worker_kv_event_view", "kvroute:worker_kv_event_blocks")
                and sample.labels["worker"] == served}

    try:
        wait_until(lambda: kv_view().get("exact") == 1.0 and kv_view().get("blocks", 0) >= 3, 20, 0.2,
                   f"the proxy to see {served}'s engine cache")
    except TimeoutError:
        print(kv_view(), fleet.workers[served][0].log()[-3000:])
        raise


def _metric(fleet: Fleet, name: str, worker: str) -> float | None:
    text = httpx.get(f"{fleet.proxy_url}/metrics", timeout=5).text
    return next((sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                 if sample.name == name and sample.labels.get("worker") == worker), None)


def _view_state(fleet: Fleet, worker: str) -> str | None:
    """The state of the proxy's view of `worker`'s engine cache: exact, incomplete or awaiting."""
    text = httpx.get(f"{fleet.proxy_url}/metrics", timeout=5).text
    return next((sample.labels["state"] for family in text_string_to_metric_families(text)
                 for sample in family.samples if sample.name == "kvroute:worker_kv_event_view"
                 and sample.labels.get("worker") == worker and sample.value == 1.0), None)


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def _send(fleet: Fleet, messages: list[dict]) -> httpx.Response:
    resp = httpx.post(f"{fleet.proxy_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp


def _prediction(fleet: Fleet, worker_id: str) -> dict:
    return fleet.workers_view()[worker_id]["cache_prediction"]["last"]


def test_the_proxys_own_token_ids_name_the_blocks_the_engines_events_name_text_image_and_conversation(fleet):
    """The proxy counts each prompt itself (the tokenizer the workers handed over), names its blocks as vLLM does
    and looks them up in each engine's KV events: what it predicts a worker holds is, token for token, what that
    engine then reports it reused, for a text prompt, an image prompt and a conversation's next turn."""
    bundle = read_model_dir(MODEL_DIR)
    wait_until(lambda: httpx.post(f"{fleet.proxy_url}/workers/vllm-a/tokenizer", json={"sha256": bundle.sha256},
                                  headers=admin_headers(fleet.proxy_url), timeout=5).json()["have"],
               60, 0.5, "the workers' tokenizer at the proxy")
    counter = PromptCounter(bundle)
    image = {"type": "image_url", "image_url": {"url": png_data_url(160, 96, (10, 200, 90))}}
    text = [{"role": "system", "content": _words("rule", 150)}, {"role": "user", "content": "first"}]
    pictured = [{"role": "user", "content": [{"type": "text", "text": _words("look", 70)}, image,
                                             {"type": "text", "text": _words("describe", 120)}]}]
    turn = [{"role": "system", "content": _words("persona", 110)}, {"role": "user", "content": _words("ask", 30)}]
    cases = {  # first request -> the request after it, sharing its prefix
        "text": (text, text[:1] + [{"role": "user", "content": "second"}]),
        "image": (pictured, pictured),
        "conversation": (turn, turn + [{"role": "assistant", "content": "noted"},
                                       {"role": "user", "content": _words("more", 120)}]),
    }
    holders = {}
    for name, (first, _) in cases.items():
        holders[name] = _send(fleet, first).headers["x-kvroute-worker"]
    for name, (first, _) in cases.items():  # each engine's BlockStored events reached the proxy's view
        blocks = (counter.count({"messages": first}, True).num_tokens - 1) // 128
        wait_until(lambda w=holders[name], n=blocks: (_metric(fleet, "kvroute:worker_kv_event_blocks", w) or 0) >= n,
                   20, 0.2, f"{name}: the engine's blocks at the proxy")
    time.sleep(RECENT_S)  # past the window in which a dispatch stands in for the engine's events
    for name, (first, then) in cases.items():
        answer = _send(fleet, then)
        served = answer.headers["x-kvroute-worker"]
        assert served == holders[name], name  # the worker whose engine holds the prefix
        reused = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        before = counter.count({"messages": first}, True).token_ids
        after = counter.count({"messages": then}, True).token_ids
        common = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(before))
        expected = min(common, len(after) - 1) // 128 * 128  # whole blocks; never the prompt's last token
        assert expected >= 256 and reused == expected, (name, reused, expected)
        assert _prediction(fleet, served) == {"predicted": reused, "actual": reused, "source": "exact"}, name


def test_a_prefix_the_engine_dropped_leaves_the_proxys_view_and_its_prediction(fleet):
    messages = [{"role": "system", "content": _words("anchor", 150)}, {"role": "user", "content": "where?"}]
    holder = _send(fleet, messages).headers["x-kvroute-worker"]
    wait_until(lambda: (_metric(fleet, "kvroute:worker_kv_event_blocks", holder) or 0) >= 3, 20, 0.2,
               "the engine's blocks at the proxy")
    for worker_id, (_, port) in fleet.workers.items():  # every engine drops its cache: none holds the prefix
        engine = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                              headers={"Authorization": f"Bearer {ENGINE_KEY}"})
        reset = engine.post("/reset_prefix_cache")  # vLLM's dev mode
        assert reset.status_code == 200 and reset.json()["success"], reset.text
        # vLLM publishes what a step changed: an idle engine's AllBlocksCleared waits for its next step (and a
        # view left incomplete by events an earlier test lost is whole again from it)
        engine.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
        engine.close()
        wait_until(lambda w=worker_id: _metric(fleet, "kvroute:worker_kv_event_blocks", w) == 0, 20, 0.2,
                   f"{worker_id}'s AllBlocksCleared at the proxy")
    time.sleep(RECENT_S)
    for worker_id in fleet.workers:  # whichever serves it next, its view is its engine's own events
        wait_until(lambda w=worker_id: _view_state(fleet, w) == "exact", 20, 0.2,
                   f"{worker_id}'s exact view at the proxy")
    served = _send(fleet, messages).headers["x-kvroute-worker"]
    assert _prediction(fleet, served) == {"predicted": 0, "actual": 0, "source": "exact"}, fleet.workers_view()[served]


def test_chat_with_text(fleet):
    raw = chat(fleet, "Describe a harbour at dawn.", max_tokens=8)
    completion = raw.parse()
    assert raw.headers["x-kvroute-worker"] in fleet.workers
    assert completion.model == MODEL
    assert completion.usage.completion_tokens == 8
    assert isinstance(completion.choices[0].message.content, str)


def test_images_go_through_the_vision_path(fleet):
    text_only = chat(fleet, [{"type": "text", "text": "What is in the picture?"}]).parse().usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": png_data_url(96, 64, (200, 40, 40))}}
    other = {"type": "image_url", "image_url": {"url": png_data_url(64, 128, (20, 90, 200))}}
    one = chat(fleet, [image, {"type": "text", "text": "What is in the picture?"}]).parse()
    two = chat(fleet, [image, other, {"type": "text", "text": "What is in the picture?"}]).parse()
    # 96x64 px = 3x2 merged 32 px patches = 6 image tokens, 64x128 = 8; plus vision start/end each.
    assert one.usage.prompt_tokens == text_only + 6 + 2
    assert two.usage.prompt_tokens == text_only + (6 + 2) + (8 + 2)
    assert one.usage.completion_tokens == two.usage.completion_tokens == 6


def test_streaming_chat_reports_usage_in_the_last_chunk(fleet):
    stream = client(fleet).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # relayed as it is produced, not as one body
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_completions_endpoint(fleet):
    completion = client(fleet).completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5,
                                                  extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 5
    assert isinstance(completion.choices[0].text, str)


async def test_load_reports_show_kv_usage_under_load(fleet):
    api = AsyncOpenAI(base_url=f"{fleet.proxy_url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "Tell a long story about " + " ".join(f"ship{i}" for i in range(120))
    seen: dict[str, float] = {}

    async def watch(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=5) as http:
            while not done.is_set():
                for w in (await http.get(f"{fleet.proxy_url}/workers")).json()["workers"]:
                    report = w.get("last_report") or {}
                    seen[w["worker_id"]] = max(seen.get(w["worker_id"], 0.0), report.get("kv_cache_usage", 0.0))
                await asyncio.sleep(0.1)

    done = asyncio.Event()
    watcher = asyncio.create_task(watch(done))
    try:
        results = await asyncio.gather(*[
            api.completions.create(model=MODEL, prompt=f"{i}: {prompt}", max_tokens=120,
                                   extra_body={"ignore_eos": True}) for i in range(16)])
    finally:
        done.set()
        await watcher
        await api.close()
    assert all(r.usage.completion_tokens == 120 for r in results)
    assert seen and max(seen.values()) > 0.1, seen
    # Once idle, the engines say so again.
    wait_until(lambda: all(((w.get("last_report") or {}).get("num_running", 1) == 0)
                           for w in fleet.workers_view().values()), 30, 0.2, "reports to show idle engines")
    # The reports carry the engine's own prefill rate and decode step time (vLLM's histograms), which
    # the routing model learns from: plausible figures for a tiny model on a CPU.
    reports = [w.get("last_report") or {} for w in fleet.workers_view().values()]
    measured = [r for r in reports if r.get("prefill_tokens_per_s") and r.get("decode_step_s")]
    assert measured, reports
    for report in measured:
        assert 10 < report["prefill_tokens_per_s"] < 10_000_000
        assert 0.0001 < report["decode_step_s"] < 5


async def test_unreachable_image_urls_get_a_4xx_each_and_valid_requests_meanwhile_are_served(fleet):
    # issue 12: vLLM answered these with a 500 that the proxy retried and counted against both breakers
    dead_url = f"http://127.0.0.1:{free_port()}/cat.png"  # nothing listens there: the engine cannot fetch it
    bad_content = [{"type": "image_url", "image_url": {"url": dead_url}}, {"type": "text", "text": "what is this?"}]
    async with httpx.AsyncClient(base_url=fleet.proxy_url, timeout=120) as http:
        def send(content):
            return http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                                                           "messages": [{"role": "user", "content": content}]})

        responses = await asyncio.gather(*[send(bad_content) for _ in range(6)],
                                         *[send(f"valid question {i}") for i in range(30)])
    bad, good = responses[:6], responses[6:]
    assert all(400 <= r.status_code < 500 for r in bad), [(r.status_code, r.text[:200]) for r in bad]
    assert all(isinstance(r.json()["error"]["message"], str) for r in bad)
    assert [r.status_code for r in good] == [200] * 30, [r.text[:200] for r in good if r.status_code != 200]
    view = fleet.workers_view()
    assert {w["state"] for w in view.values()} == {"ready"} and not any(w["breaker_open"] for w in view.values())


def test_a_stream_whose_engine_is_killed_mid_stream_completes_on_the_other_as_one_stream(fleet):
    # Runs before the kill test below and kills the same engine (vllm-a's), mid-stream: that test then
    # checks what follows (the supervisor reports it failed, traffic moves to vllm-b).
    supervisor, port = fleet.workers["vllm-a"]
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "stream": True,
            # continuous usage: every chunk says how many tokens so far (the proxy then counts exactly)
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.Client(base_url=fleet.proxy_url, timeout=120) as http, contextlib.ExitStack() as held:
        # kv_aware sends a stream where the load is lowest: open streams until one runs on vllm-a
        for i in range(6):
            resp = held.enter_context(http.stream("POST", "/v1/chat/completions", json={
                **body, "messages": [{"role": "user", "content": f"Write a long letter, number {i}."}]}))
            assert resp.status_code == 200
            if resp.headers["x-kvroute-worker"] == "vllm-a":
                break
        else:
            pytest.fail("no stream was routed to vllm-a")
        raw, killed = b"", False
        for piece in resp.iter_raw():
            raw += piece
            if not killed and raw.count(b"\n\n") >= 20:
                os.kill(engine_pid(port), signal.SIGKILL)
                killed = True
    assert killed
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-2:]
    assert len({c["id"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {MODEL}
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")) == 1
    running = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c.get("usage")]
    assert running == sorted(running) and len(set(running)) == len(running)  # no token counted twice
    assert chunks[-1]["usage"]["completion_tokens"] == 200  # exactly max_tokens, across both engines
    assert supervisor.popen.wait(60) == 1  # vllm-a's engine really died under the stream


def test_killed_engine_is_reported_failed_and_traffic_moves_to_the_other(fleet):
    victim, survivor = "vllm-a", "vllm-b"
    supervisor, port = fleet.workers[victim]
    pid = engine_pid(port)
    if pid is not None:  # else the migration test above killed it mid-stream
        os.kill(pid, signal.SIGKILL)

    assert supervisor.popen.wait(60) == 1  # the supervisor noticed, reported, stopped, exited non-zero
    assert "reported state 'failed'" in supervisor.log()
    view = fleet.workers_view()
    assert view[victim]["last_report"]["state"] == "failed"
    assert view[victim]["state"] != "ready"
    wait_until(lambda: engine_pid(port) is None, 10, what="no engine process left on the victim's port")

    served_by = [chat(fleet, f"question {i}").headers["x-kvroute-worker"] for i in range(6)]
    assert served_by == [survivor] * 6


def test_sigterm_drains_in_flight_work_then_stops_the_engine(fleet):
    worker_id = "vllm-b"
    supervisor, port = fleet.workers[worker_id]
    # The engine answers only with its key: nothing on the host reaches it around the proxy.
    bypass = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="guessed", max_retries=0, timeout=30)
    with pytest.raises(AuthenticationError):
        bypass.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    engine = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=ENGINE_KEY, max_retries=0, timeout=120)
    # Straight to this worker's engine, streamed: the first chunk proves the request is running there.
    # 600 tokens: long enough that the drain must wait for it, short enough to end well within the 60 s grace
    # on two loaded cores (1900 took 43 s beside the other tests and was cut once in CI)
    stream = engine.chat.completions.create(
        model=MODEL, max_tokens=600, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Write a very long letter."}], extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    supervisor.signal(signal.SIGTERM)
    wait_until(lambda: "draining" in supervisor.log(), 10, what="the supervisor to start draining")
    # Stopping the engine now would cut the stream short; draining lets it finish.
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 600
    assert supervisor.popen.wait(60) == 0
    assert worker_id not in fleet.workers_view()  # deregistered on the way out
    wait_until(lambda: engine_pid(port) is None, 10, what="the engine to be stopped")
