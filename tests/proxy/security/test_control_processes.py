"""The control plane's security with real processes (issue 11): `kvroute proxy` and `kvroute up` refuse an open
control plane off loopback, a sim worker registers, reports and leaves with its own secret, the worker gives its
engine an API key, and callers on other hosts (network namespaces on a private bridge) get nothing without
credentials, spoofed addresses included. The in-process cases are test_control.py's.
"""

from __future__ import annotations

import os
import stat

import pytest

from proxy.security import peer
from tests.proxy.security.control_support import (
    ADMIN,
    TOKENS,
    WORKER_TOKEN,
)
from tests.support.procs import free_port, wait_until

# --- start-up -----------------------------------------------------------------------------------------

def test_kvroute_proxy_refuses_a_non_loopback_bind_without_a_token(procs):
    refused = procs.kvroute("proxy", "--host", "0.0.0.0", "--port", "0", name="open-proxy",
                            env={"KVROUTE_ADMIN_TOKEN": ""})
    assert refused.popen.wait(30) == 2
    log = refused.log()
    assert "refusing to listen on 0.0.0.0 with an open control plane" in log and "listening" not in log

    port = free_port()
    insecure = procs.kvroute("proxy", "--host", "0.0.0.0", "--port", str(port), "--insecure-open-control-plane",
                             name="insecure-proxy", env={"KVROUTE_ADMIN_TOKEN": ""})
    wait_until(lambda: "listening" in insecure.log(), 30, what="the insecure proxy to start")
    assert "WARNING: --insecure-open-control-plane" in insecure.log()
    insecure.stop()

    tokened = procs.kvroute("proxy", "--host", "0.0.0.0", "--port", str(free_port()), name="tokened-proxy",
                            env={"KVROUTE_ADMIN_TOKEN": "s3cret"})
    wait_until(lambda: "listening" in tokened.log(), 30, what="the proxy with a token to start")
    assert "WARNING" not in tokened.log()


def test_kvroute_up_off_loopback_generates_a_private_token_that_status_finds(procs, tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text("proxy:\n  log_level: info\nmodels: []\n")
    port = free_port()
    env = {"KVROUTE_CONFIG_DIR": str(tmp_path / "cfg"), "KVROUTE_ADMIN_TOKEN": ""}
    up = procs.kvroute("up", str(config), "--host", "0.0.0.0", "--port", str(port), "--no-watch",
                       "--ready-timeout-s", "1", name="up", env=env)
    token_file = tmp_path / "cfg" / f"admin-token-{port}"
    wait_until(lambda: "ready" in up.log() or "not every worker" in up.log(), 60, what="kvroute up to start")
    assert str(token_file) in up.log()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in up.log()

    import subprocess

    from tests.support.procs import KVROUTE
    run_env = {**os.environ, **env}
    status = subprocess.run([*KVROUTE, "status", "--proxy", f"http://127.0.0.1:{port}"], capture_output=True,
                            text=True, timeout=60, env=run_env)
    assert status.returncode == 0, status.stderr
    other = subprocess.run([*KVROUTE, "scale", "m", "1", "--proxy", f"http://127.0.0.1:{port}"], capture_output=True,
                           text=True, timeout=60, env={**run_env, "KVROUTE_CONFIG_DIR": str(tmp_path / "none")})
    assert other.returncode == 1 and "admin token" in other.stderr


# --- a real worker process ------------------------------------------------------------------------------

def test_a_sim_worker_registers_with_the_worker_token_then_reports_and_leaves_with_its_own_secret(fleet, procs):
    import httpx

    fleet.start_proxy(config=TOKENS)
    port = free_port()
    sim = procs.kvroute("worker", "--engine", "sim", "--port", str(port), "--served-model-name", "m1",
                        "--time-scale", "20", "--proxy-url", fleet.url, "--worker-id", "sim-a", name="sim-a",
                        env={"KVROUTE_WORKER_TOKEN": WORKER_TOKEN})
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def reporting() -> dict | None:
        w = httpx.get(f"{fleet.url}/workers/sim-a", headers=admin, timeout=5).json()
        return w if w.get("state") == "ready" and (w.get("last_report") or {}).get("seq", 0) >= 3 else None

    wait_until(reporting, 30, 0.1, "sim-a to register and report with its secret")
    assert "report rejected" not in sim.log()
    sim.stop()  # SIGTERM: drain, then DELETE /workers/sim-a with its secret
    assert httpx.get(f"{fleet.url}/workers/sim-a", headers=admin, timeout=5).status_code == 404


def test_the_worker_gives_its_engine_a_key_of_its_own_and_keeps_one_the_operator_gave():
    from backends.worker import engine_api_key

    key, args, env = engine_api_key("vllm", ["--max-num-seqs", "8"], {})
    assert args == [] and env == {"VLLM_API_KEY": key} and len(key) >= 24  # env: not visible in `ps`
    other, _, _ = engine_api_key("vllm", [], {})
    assert other != key
    key, args, env = engine_api_key("turbomind", [], {})
    assert args == ["--api-keys", key] and env == {}
    assert engine_api_key("vllm", ["--api-key", "mine"], {}) == ("mine", [], {})
    assert engine_api_key("vllm", [], {"VLLM_API_KEY": "env-key"}) == ("env-key", [], {})
    assert engine_api_key("turbomind", ["--api-keys=given"], {})[0] == "given"


# --- real non-loopback callers: hosts as network namespaces on a private bridge ---------------------------

def test_callers_on_other_hosts_get_no_control_plane_without_credentials_even_when_spoofing(procs, tmp_path):
    import json
    import sys

    import httpx

    from tests.support.netns import ROOT_ADDRESS, namespaces_error, network
    from tests.support.procs import wait_http_ok

    if (why := namespaces_error()) is not None:
        pytest.fail(why)  # as tests/multihost does: real namespaces are part of the test
    config = tmp_path / "proxy.yaml"
    config.write_text(TOKENS + f"  trusted_worker_networks: [{ROOT_ADDRESS}/32]\n")
    with network(procs, ["a", "b"]) as net:
        a, b = net["a"], net["b"]
        a.kvroute("proxy", "--host", "0.0.0.0", "--port", "8000", "--config", str(config), name="proxy")
        url = a.url(8000)
        wait_http_ok(url + "/health", timeout=30)
        # B claims to be the trusted root address; the data plane replaces the claim with B's own.
        spoof = {peer.CLIENT_ADDR_HEADER: ROOT_ADDRESS, peer.HOP_SECRET_HEADER: "guess"}
        with httpx.Client(timeout=10) as http:  # this process: 10.203.0.1, trusted for registration only
            assert http.get(url + "/workers").status_code == 403  # known, but not an admin
            assert http.get(url + "/workers", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
            nothing_there = http.post(url + "/nodes/add", json={"url": f"http://{b.address}:9"})
            assert nothing_there.status_code == 400  # trusted: past auth, to a probe that finds nothing
            assert nothing_there.json()["error"]["code"] == "worker_unreachable"
            assert http.post(url + "/fleet/scale", json={"model": "m", "replicas": 1}).status_code == 403
        script = (f"import httpx, json; u = {url!r}; s = {json.dumps(spoof)!r}\n"
                  "out = [httpx.get(u + '/workers').status_code,\n"
                  f"       httpx.post(u + '/nodes/add', json={{'url': {b.url(9)!r}}}, headers=json.loads(s)).status_code,\n"
                  f"       httpx.post(u + '/workers', json={{'url': {b.url(9)!r}, 'models': ['m']}},\n"
                  f"                  headers={{'Authorization': 'Bearer {WORKER_TOKEN}'}}).status_code]\n"
                  "print(json.dumps(out))")
        result = b.run([sys.executable, "-c", script])
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1]) == [401, 401, 200]
