"""Exact prompt tokens against a real vLLM CPU engine (the tiny Qwen3-VL): the proxy counts as the engine does.

One engine for the module, under `kvroute worker` (which hands proxy A the model's tokenizer), and the same
engine registered by URL only with proxy B (no tokenizer: B forwards whatever comes and relays the engine's
answer). max_model_len 512 keeps the prompts at the boundary cheap to prefill.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from proxy.tokens.bundle import read_model_dir
from proxy.tokens.counter import PromptCounter
from tests.support.procs import (
    KVROUTE,
    REPO,
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
LIMIT = 512
ENGINE_KEY = "exact-tokens-engine-key"  # operator-given, so this test may also call the engine itself
ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(8 * 1024 * 1024), "--max-num-seqs", "4",
               "--max-model-len", str(LIMIT)]


@dataclass
class Setup:
    with_tokenizer: str  # proxy A: the worker handed it the tokenizer
    url_only: str  # proxy B: the same engine, registered by URL
    engine: str
    counter: PromptCounter

    def chat(self, base: str, body: dict, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, **body}, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[Setup]:
    log_dir = tmp_path_factory.mktemp("exact-tokens")
    group = ProcessGroup(log_dir)
    try:
        bundle = read_model_dir(MODEL_DIR)
        assert bundle is not None, "build the tiny model first: kvroute make-tiny-model models/tiny-qwen3-vl"
        proxies = []
        for name in ("proxy-a", "proxy-b"):
            port = free_port()
            group.start([*KVROUTE, "proxy", "--port", str(port)], name=name)
            proxies.append(f"http://127.0.0.1:{port}")
            wait_http_ok(proxies[-1] + "/health", timeout=30)
        a, b = proxies
        engine_port = free_port()
        worker = group.start(
            [*KVROUTE, "worker", "--engine", "vllm", "--model", str(MODEL_DIR), "--device", "cpu",
             "--served-model-name", MODEL, "--port", str(engine_port), "--worker-id", "vllm-t", "--proxy-url", a,
             "--", *ENGINE_ARGS], name="vllm-t", env={"KVROUTE_LOG_DIR": str(log_dir), "VLLM_API_KEY": ENGINE_KEY})
        engine = f"http://127.0.0.1:{engine_port}"

        def handed_over() -> bool:
            assert worker.alive(), f"worker exited early:\n{worker.log()[-4000:]}"
            resp = httpx.post(f"{a}/workers/vllm-t/tokenizer", json={"sha256": bundle.sha256},
                              headers=admin_headers(a), timeout=5)
            return resp.status_code == 200 and resp.json()["have"]

        wait_until(handed_over, 240, 0.5, "the vLLM worker to register and hand over its tokenizer")
        httpx.post(f"{b}/workers", headers=admin_headers(b), timeout=10, json={
            "worker_id": "raw", "url": engine, "models": [MODEL], "engine": "vllm", "reports": False,
            "api_key": ENGINE_KEY}).raise_for_status()
        wait_until(lambda: httpx.get(f"{b}/workers/raw", timeout=5).json().get("state") == "ready", 30, 0.2,
                   "the URL-only registration to be ready")
        yield Setup(a, b, engine, PromptCounter(bundle))
    except Exception:
        print(group.logs())
        raise
    finally:
        group.stop_all()


def png(width: int, height: int, color: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image(width: int, height: int, color=(200, 40, 40)) -> dict:
    return {"type": "image_url", "image_url": {"url": png(width, height, color)}}


CONVERSATIONS = {
    "text": [{"role": "user", "content": "Describe a harbour at dawn, in the style of a ship's log."}],
    "images": [{"role": "user", "content": [image(96, 64), image(700, 300, (20, 90, 200)), image(10, 10),
                                            {"type": "text", "text": "What do these pictures have in common?"}]}],
    "multi-turn": [{"role": "system", "content": "You answer in one short sentence."},
                   {"role": "user", "content": [image(128, 128), {"type": "text", "text": "What is this?"}]},
                   {"role": "assistant", "content": "A red square."},
                   {"role": "user", "content": "And now in French,\nplease?"}],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_the_proxys_count_is_the_engines_prompt_tokens(setup, name):
    messages = CONVERSATIONS[name]
    answered = setup.chat(setup.engine, {"messages": messages, "max_tokens": 1}, key=ENGINE_KEY)
    assert answered.status_code == 200, answered.text
    counted = setup.counter.count({"messages": messages}, True)
    assert counted.num_tokens == answered.json()["usage"]["prompt_tokens"]
    tokenized = httpx.post(f"{setup.engine}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60,
                           headers={"Authorization": f"Bearer {ENGINE_KEY}"}).json()
    assert counted.token_ids == tokenized["tokens"]  # the ids too: what the KV-event block hashes are made of


def prompt_of(counter: PromptCounter, tokens: int) -> list[dict]:
    text = "x"
    while (n := counter.count({"messages": [{"role": "user", "content": text}]}, True).num_tokens) < tokens:
        text += " a" * max(1, (tokens - n) // 2)
    assert n == tokens
    return [{"role": "user", "content": text}]


def test_through_kvroute_one_token_short_of_the_context_passes_and_one_more_is_refused(setup):
    fits = setup.chat(setup.with_tokenizer, {"messages": prompt_of(setup.counter, LIMIT - 1)})
    assert fits.status_code == 200, fits.text
    assert fits.headers["x-kvroute-worker"] == "vllm-t"
    assert fits.json()["usage"] == {**fits.json()["usage"], "prompt_tokens": LIMIT - 1, "completion_tokens": 1}
    pictures = [{"role": "user", "content": [image(1200, 900), image(900, 1200, (9, 9, 9)), image(640, 480, (1, 2, 3)),
                                             {"type": "text", "text": "x"}]}]
    assert setup.counter.count({"messages": pictures}, True).num_tokens > LIMIT  # 3 x 234 image tokens and text
    chars = [{"role": "user", "content": "x" + " a" * (LIMIT * setup.counter.max_chars_per_token // 2)}]
    for messages in (prompt_of(setup.counter, LIMIT), prompt_of(setup.counter, LIMIT + 1),
                     prompt_of(setup.counter, LIMIT + 60), pictures, chars):
        refused = setup.chat(setup.with_tokenizer, {"messages": messages})
        assert refused.status_code == 400 and "x-kvroute-worker" not in refused.headers  # the proxy answered
        engine = setup.chat(setup.engine, {"messages": messages}, key=ENGINE_KEY)
        assert engine.status_code == 400
        assert refused.json()["error"]["message"] == engine.json()["error"]["message"]  # word for word


def test_a_url_only_worker_gets_the_long_prompt_and_the_engines_error_comes_back(setup):
    messages = prompt_of(setup.counter, LIMIT + 40)
    relayed = setup.chat(setup.url_only, {"messages": messages, "max_tokens": 8})
    assert relayed.status_code == 400 and relayed.headers["x-kvroute-worker"] == "raw"
    error = relayed.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert f"maximum context length is {LIMIT} tokens" in error["message"]
    assert "your prompt contains at least" in error["message"]  # the engine's own words
