"""The tokenizer hand-over through a real proxy, with sim workers that count with the tiny Qwen3-VL's tokenizer.

A sim given `--tokenizer` counts prompts exactly as vLLM would with those files and hands them to the proxy,
which then refuses a prompt one token over the context and nothing shorter. The same against real vLLM:
tests/e2e/vllm/test_exact_tokens.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.tokens.bundle import read_model_dir
from proxy.tokens.counter import PromptCounter
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def bundle():
    found = read_model_dir(TINY)
    assert found is not None, "build the tiny model first: kvroute make-tiny-model models/tiny-qwen3-vl"
    return found


def content_of(counter: PromptCounter, tokens: int) -> str:
    """A user message whose chat prompt is exactly `tokens` tokens long."""
    text = "x"
    while (n := counter.count({"messages": [{"role": "user", "content": text}]}, True).num_tokens) < tokens:
        text += " a" * max(1, (tokens - n) // 2)
    assert n == tokens, (n, tokens)
    return text


def hand_over(fleet, worker_id: str, body: dict, headers: dict | None = None):
    return fleet.http.post(f"{fleet.url}/workers/{worker_id}/tokenizer", json=body,
                           headers=headers if headers is not None else fleet.admin())


def test_a_prompt_one_token_short_of_the_context_passes_and_one_more_is_refused_by_the_proxy(fleet, bundle):
    fleet.start_proxy()
    fleet.start_sims(2, kv_capacity_tokens=1024, extra=("--tokenizer", str(TINY)))  # max_model_len 1024
    limit = fleet.workers()[0]["max_model_len"]
    assert limit == 1024
    # both sims hand it over; the second finds the proxy holding it already
    wait_until(lambda: all(hand_over(fleet, w, {"sha256": bundle.sha256}).json()["have"] for w in ("sim-0", "sim-1")),
               20, 0.2, "the proxy to hold the sims' tokenizer")
    counter = PromptCounter(bundle)
    fits = fleet.chat(content_of(counter, limit - 1), max_tokens=None)  # vLLM 0.32: the rest goes to the answer
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["prompt_tokens"] == limit - 1 and fits.json()["usage"]["completion_tokens"] == 1
    full = fleet.chat(content_of(counter, limit), max_tokens=None)
    over = fleet.chat(content_of(counter, limit + 1), max_tokens=None)
    for refused in (full, over):
        assert refused.status_code == 400 and "x-kvroute-worker" not in refused.headers  # the proxy's answer
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert full.json()["error"]["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    assert over.json()["error"]["message"].startswith(
        f"This model's maximum context length is {limit} tokens. However, your prompt contains at least {limit + 1} "
        "input tokens")
    assert sum(w["dispatched_total"] for w in fleet.workers()) == 1  # the refused ones never reached an engine


def test_only_the_worker_itself_or_an_admin_hands_over_a_tokenizer_and_it_must_be_what_it_says(fleet, bundle):
    fleet.start_proxy()
    fleet.register("w-a", "http://127.0.0.1:9")
    fleet.register("w-b", "http://127.0.0.1:10")
    own = {"Authorization": f"Bearer {fleet.secrets['w-a']}"}
    other = {"Authorization": f"Bearer {fleet.secrets['w-b']}"}
    digest = {"sha256": bundle.sha256}
    assert hand_over(fleet, "w-a", digest, other).status_code == 403
    assert hand_over(fleet, "w-a", digest, {}).status_code == 401
    assert hand_over(fleet, "nobody", digest).status_code == 404
    assert hand_over(fleet, "w-a", digest, own).json() == {"have": False, "models": []}
    tampered = hand_over(fleet, "w-a", {"sha256": "0" * 64, "bundle": bundle.to_wire()}, own)
    assert tampered.status_code == 400 and tampered.json()["error"]["code"] == "invalid_tokenizer"
    assert hand_over(fleet, "w-a", {"sha256": "../../x"}, own).status_code == 400
    as_form = fleet.http.post(f"{fleet.url}/workers/w-a/tokenizer", content=b"sha256=1",
                              headers={**own, "Content-Type": "application/x-www-form-urlencoded"})
    assert as_form.status_code == 415
    taken = hand_over(fleet, "w-a", {**digest, "bundle": bundle.to_wire()}, own)
    assert taken.status_code == 200 and taken.json() == {"have": True, "models": ["m1"]}
    assert hand_over(fleet, "w-b", digest, other).json()["have"]  # a second worker: the digest is enough
