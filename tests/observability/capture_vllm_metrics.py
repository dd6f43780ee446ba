"""Refresh tests/data/vllm_metrics.txt: one real vLLM CPU worker's /metrics text, after a few requests.

Not a test (pytest does not collect it): run `.venv/bin/python -m tests.observability.capture_vllm_metrics`
when the vLLM version changes. It starts `kvroute worker --engine vllm` on the tiny Qwen3-VL (~30-70 s,
~3 GB of memory), sends three chat requests, saves GET /metrics, and stops the worker by PID.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx

from tests.support.procs import KVROUTE, REPO, ProcessGroup, free_port, wait_http_ok

OUT = REPO / "tests" / "data" / "vllm_metrics.txt"
MODEL_DIR = REPO / "models" / "tiny-qwen3-vl"
API_KEY = "capture-only"  # the worker gives its engine this key (VLLM_API_KEY) instead of a random one
ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(8 * 1024 * 1024), "--max-num-seqs", "16",
               "--max-model-len", "2048"]


def main() -> int:
    group = ProcessGroup(Path(tempfile.mkdtemp(prefix="kvroute-capture-")))
    try:
        port = free_port()
        worker = group.start([*KVROUTE, "worker", "--engine", "vllm", "--model", str(MODEL_DIR), "--device", "cpu",
                              "--served-model-name", "tiny", "--port", str(port), "--worker-id", "capture",
                              "--", *ENGINE_ARGS], name="vllm-worker", env={"VLLM_API_KEY": API_KEY})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http_ok(url + "/health", timeout=900)  # a busy 2-core machine needs minutes
        except TimeoutError:
            print(worker.log()[-4000:], file=sys.stderr)
            raise
        for i in range(3):
            httpx.post(url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}, json={
                "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": f"hello {i}"}]}
            ).raise_for_status()
        text = httpx.get(url + "/metrics", timeout=30).text
        version = httpx.get(url + "/version", timeout=5).json().get("version", "?")
        OUT.write_text(f"# captured from a real vLLM {version} CPU worker (tiny Qwen3-VL) by "
                       f"tests/observability/capture_vllm_metrics.py\n" + text)
        print(f"wrote {OUT} ({len(text)} bytes, vLLM {version})")
        return 0
    finally:
        group.stop_all()


if __name__ == "__main__":
    sys.exit(main())
