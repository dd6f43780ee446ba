"""One real vLLM CPU engine on another machine: `kvroute worker --engine vllm` bound to 0.0.0.0 on host B
(a network namespace), `kvroute proxy` on host A, and an image request from a third address through A.

Slow (~30-70 s for the engine to start, ~3 GB of memory); run: .venv/bin/pytest -q tests/e2e/vllm/test_vllm_hosts.py
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.vllm.test_vllm_fleet import ENGINE_ARGS, MODEL, MODEL_DIR, WORKER_START_TIMEOUT_S, png_data_url
from tests.multihost.support import ADMIN, PROXY_PORT, WORKER_TOKEN, proxy_config, start_proxy, workers
from tests.support.netns import namespaces_error, network
from tests.support.procs import KVROUTE, wait_until

pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(420),
]


def test_a_vllm_worker_on_another_host_answers_an_image_through_the_proxy(procs, tmp_path):
    if (why := namespaces_error()) is not None:
        pytest.fail(why)  # real network namespaces are part of this test: forbidden here, it fails
    assert (MODEL_DIR / "config.json").exists(), "run `make setup` (it builds models/tiny-qwen3-vl)"
    with network(procs, ["a", "b"]) as net:
        a, b = net["a"], net["b"]
        start_proxy(a, proxy_config(tmp_path))
        worker = b.start([*KVROUTE, "worker", "--engine", "vllm", "--model", str(MODEL_DIR), "--device", "cpu",
                          "--host", "0.0.0.0", "--port", "8101", "--served-model-name", MODEL,
                          "--worker-id", "vllm-b", "--proxy-url", a.url(PROXY_PORT), "--proxy-token", WORKER_TOKEN,
                          "--", *ENGINE_ARGS], name="vllm-b", env={"KVROUTE_LOG_DIR": str(tmp_path)})

        def ready() -> bool:
            assert worker.alive(), f"worker exited early:\n{worker.log()[-4000:]}"
            return workers(a).get("vllm-b", {}).get("state") == "ready"

        wait_until(ready, WORKER_START_TIMEOUT_S, 0.5, "the vLLM worker on B to register ready")
        view = workers(a)["vllm-b"]
        assert view["url"] == f"http://{b.address}:8101" and view["engine"] == "vllm"

        image = {"type": "image_url", "image_url": {"url": png_data_url(96, 64, (200, 40, 40))}}
        body = {"model": MODEL, "max_tokens": 6, "ignore_eos": True,
                "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]}
        r = httpx.post(f"{a.url(PROXY_PORT)}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-worker"] == "vllm-b"
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["usage"]["prompt_tokens"] > 6 + 2  # the image's 6 tokens and its start/end went in
        assert httpx.get(f"{a.url(PROXY_PORT)}/workers", headers=ADMIN, timeout=5).status_code == 200
