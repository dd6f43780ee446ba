"""When the sim's stream sends what: the head at once, the first SSE chunk only with the first token (as vLLM)."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from backends.sim.cost import StepWork, step_time_s
from backends.sim.presets import get_preset

pytestmark = pytest.mark.timeout(60)

PRESET = "h100-qwen3-vl-8b"
TIME_SCALE = 0.1  # a simulated second lasts 10 wall seconds: the prefill below takes ~1 s on the wall clock


def prefill_wall_s(prompt_tokens: int) -> float:
    """The least wall time the sim can take to compute this prompt (one step; chunking only adds)."""
    work = StepWork(prefill_tokens=prompt_tokens, prefill_seqs=1, kv_tokens_read=prompt_tokens,
                    attention_pairs=prompt_tokens * (prompt_tokens + 1) // 2)
    return step_time_s(get_preset(PRESET), work) / TIME_SCALE


def timed_events(resp: httpx.Response) -> list[tuple[float, bytes]]:
    """(monotonic arrival time, data) of each SSE event, as the bytes come off the socket."""
    events, buffer = [], b""
    for raw in resp.iter_raw():
        at = time.monotonic()
        buffer += raw
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if event.startswith(b"data: "):
                events.append((at, event[len(b"data: "):]))
    return events


def words(n: int, salt: str) -> str:
    return " ".join(f"{salt}{i % 97}" for i in range(n))


@pytest.fixture
def worker(sim):
    _, url = sim("--preset", PRESET, "--time-scale", str(TIME_SCALE), "--served-model-name", "m")
    return url


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_timing_the_first_chunk_sees_the_prefill(worker, path):
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": words(2500, "chat")}]}
    else:
        body = {"prompt": words(2500, "text")}
    prompt_tokens = httpx.post(f"{worker}/tokenize", json=body, timeout=10).json()["count"]
    assert prompt_tokens > 2000
    prefill = prefill_wall_s(prompt_tokens)
    body |= {"model": "m", "max_tokens": 3, "stream": True}

    sent = time.monotonic()
    with httpx.stream("POST", worker + path, json=body, timeout=30) as resp:
        head = time.monotonic() - sent
        events = [(at - sent, data) for at, data in timed_events(resp)]
    assert resp.status_code == 200
    assert head < prefill / 2, "the head goes out before the engine has computed anything"

    chunks = [orjson.loads(data) for _, data in events if data != b"[DONE]"]
    texts = [c["choices"][0]["delta" if "delta" in c["choices"][0] else "text"] for c in chunks]
    if path == "/v1/chat/completions":
        assert texts[0] == {"role": "assistant", "content": ""}  # its own event, as vLLM's
        assert [t["content"] != "" for t in texts[1:]] == [True] * 3
        # the role and the first token go out together: no gap a client could take for a token
        assert events[1][0] - events[0][0] < 0.05
    else:
        assert len(texts) == 3 and all(texts)
    first_chunk_at = events[0][0]
    assert first_chunk_at >= prefill, f"first chunk after {first_chunk_at:.2f}s, before the prefill ({prefill:.2f}s)"
