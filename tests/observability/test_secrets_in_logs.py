"""Secrets never reach a log: a worker started with an engine key and a proxy URL holding a token logs its
engine's command line, the engine's own start-up lines and its registration with every secret masked.
"""

from __future__ import annotations

import pytest

from proxy.security.redact import redact_text
from tests.support.procs import free_port, wait_until

pytestmark = pytest.mark.timeout(60)

ENGINE_KEY = "sk-engine-key-123"
HF_TOKEN = "hf_token_value_456"
PROXY_TOKEN = "proxy-basic-token-789"

# Stands in for `python -m vllm.entrypoints.openai.api_server`: prints its arguments as vLLM 0.x does at
# start-up, then idles (never ready: the test reads the logs and stops the worker).
FAKE_VLLM = '''
import sys, time
args = sys.argv[1:]
key = args[args.index("--api-key") + 1]
print(f"INFO 12-01 10:00:00 [utils.py:233] non-default args: {{'model_tag': 'm', 'api_key': [{key!r}], "
      f"'hf_token': '{HF_TOKEN}', 'port': 1}}", flush=True)
print(f"INFO 12-01 10:00:00 [api_server.py:1] args: Namespace(api_key=[{key!r}], max_num_batched_tokens=512)",
      flush=True)
time.sleep(60)
'''


def test_a_workers_logs_hold_no_engine_key_or_proxy_token(procs, tmp_path):
    fake = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    fake.mkdir(parents=True)
    for folder in (fake.parent.parent, fake.parent, fake):
        (folder / "__init__.py").write_text("")
    (fake / "api_server.py").write_text(FAKE_VLLM.replace("{HF_TOKEN}", HF_TOKEN))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    proxy_url = f"http://kvroute:{PROXY_TOKEN}@127.0.0.1:{free_port()}"
    worker = procs.kvroute("worker", "--engine", "vllm", "--model", "m", "--device", "cpu", "--port",
                           str(free_port()), "--proxy-url", proxy_url, "--startup-timeout-s", "30", "--",
                           "--api-key", ENGINE_KEY, "--hf-token", HF_TOKEN, name="worker",
                           env={"PYTHONPATH": str(tmp_path / "fake"), "KVROUTE_LOG_DIR": str(log_dir)})
    engine_logs = wait_until(lambda: (lambda text: text if "Namespace(" in text else None)(
        "".join(p.read_text() for p in log_dir.glob("kvroute-engine-*.log"))), 30, 0.1, "the engine's start-up lines")
    wait_until(lambda: "starting engine" in worker.log() and "Namespace(" in worker.log(), 10, 0.1,
               "the worker's own log")
    text = worker.log() + engine_logs
    for secret in (ENGINE_KEY, HF_TOKEN, PROXY_TOKEN):
        assert secret not in text, secret
    assert "--api-key ***" in worker.log() and "'api_key': '***'" in engine_logs


def test_a_proxy_url_with_a_token_is_logged_without_it(procs):
    """LMDeploy-style `--proxy-url http://user:TOKEN@host`: the registration log lines show the URL masked."""
    port = free_port()
    sim = procs.kvroute("worker", "--engine", "sim", "--port", str(free_port()), "--served-model-name", "m",
                        "--proxy-url", f"http://kvroute:{PROXY_TOKEN}@127.0.0.1:{port}", name="sim")
    wait_until(lambda: "not reachable" in sim.log(), 30, 0.1, "the worker logging that the proxy is not there")
    assert PROXY_TOKEN not in sim.log() and f"http://***@127.0.0.1:{port}" in sim.log()


def test_redaction_covers_the_shapes_engines_print():
    assert redact_text("non-default args: {'api_key': ['sk-1', 'sk-2'], 'port': 8001}") == (
        "non-default args: {'api_key': '***', 'port': 8001}")
    assert redact_text('{"api_key": "sk-4", "max_tokens": 5}') == '{"api_key": "***", "max_tokens": 5}'
    assert redact_text("Namespace(api_keys=['k1'], max_num_batched_tokens=512)") == (
        "Namespace(api_keys=***, max_num_batched_tokens=512)")
