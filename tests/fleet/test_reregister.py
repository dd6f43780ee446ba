"""A worker outlives a proxy restart: it registers again by itself and serves without any operator step."""

from __future__ import annotations

import httpx
import pytest

from tests.support.procs import free_port, wait_until

pytestmark = pytest.mark.timeout(120)


def test_worker_reregisters_after_the_proxy_restarts(procs):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proxy = procs.kvroute("proxy", "--port", str(port), name="proxy")
    procs.kvroute("worker", "--engine", "sim", "--port", "0", "--served-model-name", "tiny", "--worker-id", "w-0",
                  "--proxy-url", url, "--time-scale", "10", name="worker")

    def registered() -> bool:
        body = httpx.get(f"{url}/workers", timeout=2).json()
        workers = body.get("workers", body) if isinstance(body, dict) else body
        return any(w["worker_id"] == "w-0" and w["state"] == "ready" for w in workers)
    wait_until(registered, 30, 0.1, "the worker to register")

    assert proxy.stop() is not None  # the proxy goes away; the worker keeps running
    procs.kvroute("proxy", "--port", str(port), name="proxy-again")
    wait_until(registered, 30, 0.1, "the worker to register with the new proxy")
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "w-0"
