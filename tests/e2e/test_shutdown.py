"""Stopping a proxy under traffic: new requests get 503 `shutting_down` at once, streams in flight finish,
and the process exits within drain_grace_s (no silent minute)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.e2e.test_forwarding import sse_events

pytestmark = pytest.mark.timeout(120)

GRACE_S = 15


def test_sigterm_refuses_new_requests_finishes_streams_and_exits_within_the_grace(fleet, procs):
    fleet.start_proxy(config=f"proxy:\n  drain_grace_s: {GRACE_S}\n")
    proxy = next(p for p in procs.procs if p.name == "proxy")
    fleet.start_sims(1, time_scale=1.0)
    result: dict[str, object] = {}
    first_chunk = threading.Event()

    def long_stream() -> None:
        with httpx.stream("POST", fleet.url + "/v1/chat/completions", timeout=60, json={
                "model": "m1", "stream": True, "max_tokens": 150, "ignore_eos": True,
                "messages": [{"role": "user", "content": "tell me a long story"}]}) as resp:
            chunks = []
            for chunk in resp.iter_bytes():
                chunks.append(chunk)
                first_chunk.set()
            result["status"], result["raw"] = resp.status_code, b"".join(chunks)

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    assert first_chunk.wait(30)
    proxy.signal(signal.SIGTERM)
    stopped_at = time.monotonic()

    refused = _post_until_refused(fleet.url)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert int(refused.headers["Retry-After"]) >= 1

    streaming.join(60)
    assert result["status"] == 200
    events = sse_events(result["raw"])
    assert events[-1] == b"[DONE]" and not any(b'"error"' in e for e in events)

    proxy.popen.wait(GRACE_S + 10)
    assert time.monotonic() - stopped_at < GRACE_S + 5


def _post_until_refused(url: str) -> httpx.Response:
    """A new request once SIGTERM has landed (the first may still race it): answered, never hanging."""
    deadline = time.monotonic() + 10
    while True:
        resp = httpx.post(url + "/v1/chat/completions", timeout=10, json={
            "model": "m1", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        if resp.status_code == 503 or time.monotonic() > deadline:
            return resp
        time.sleep(0.05)
