"""The load generator's TTFT: timed to the chunk with the first generated token, whatever comes before it."""

from __future__ import annotations

import orjson
import pytest

from bench import loadgen
from bench.loadgen import Result, carries_token


def chat(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_only_chunks_with_a_generated_token_count():
    assert not carries_token(chat({"role": "assistant", "content": ""}))  # vLLM's opening chunk
    assert carries_token(chat({"content": "Hello"}))
    assert carries_token(chat({"content": ""}, finish="length"))  # the last token may decode to nothing
    assert carries_token(chat({"role": "assistant", "content": "Hi"}))  # LMDeploy repeats the role
    assert carries_token({"choices": [{"index": 0, "text": "", "finish_reason": None}]})  # a completion's token
    assert not carries_token({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    assert not carries_token({"error": {"message": "boom"}})


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _Stream:
    """A response whose chunks arrive at given (fake) times."""

    def __init__(self, clock: _Clock, chunks: list[tuple[float, bytes]]) -> None:
        self.clock, self.chunks = clock, chunks
        self.content = self

    async def iter_any(self):
        for at, data in self.chunks:
            self.clock.now = at
            yield data


def sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@pytest.mark.parametrize("role_at", [0.05, 2.0])
async def test_a_stream_that_opens_early_is_timed_to_its_first_token(monkeypatch, role_at):
    clock = _Clock()
    monkeypatch.setattr(loadgen.time, "perf_counter", clock)
    # the role chunk early (a router or engine that sends it at admission), or with the token (vLLM)
    stream = _Stream(clock, [(role_at, sse(chat({"role": "assistant", "content": ""}))),
                             (2.0, sse(chat({"content": "Once"}))),
                             (2.5, sse(chat({"content": " upon"}, finish="length")) + b"data: [DONE]\n\n")])
    res = Result(index=0, tag="", status=200, sent_at=0.0, latency_s=0.0)
    await loadgen._consume_stream(stream, res, t0=0.0)
    assert res.ttft_s == 2.0 and res.completion_tokens == 2
