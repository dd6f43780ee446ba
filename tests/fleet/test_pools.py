"""`kvroute up` on a disaggregated sim model: each pool starts with its role, the workers say which, the
status table shows it, and scaling one pool under load fails no request. Real processes, real HTTP."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.fleet.support import Fleet, SteadyLoad
from tests.support.procs import KVROUTE, wait_until

pytestmark = pytest.mark.timeout(240)

CONFIG = """
    proxy:
      drain_grace_s: 20
    models:
      - name: pd
        engine: sim
        preset: cpu-tiny
        device: cpu
        engine_args: {{time-scale: 1}}
        kv_transfer: {{link: tcp-25g}}
        pools:
          - {{role: prefill, replicas: 1, engine_args: {{max-num-batched-tokens: 1024}}}}
          - {{role: decode, replicas: {decode}}}
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=60)


def test_pools_start_with_their_roles_and_one_pool_scales_under_load_without_a_failed_request(procs, tmp_path):
    fleet = Fleet(procs, tmp_path, CONFIG.format(decode=1))
    try:
        fleet.wait_workers({"pd-prefill-0", "pd-decode-0"})
        workers = fleet.workers()
        assert {wid: w["role"] for wid, w in workers.items()} == {"pd-prefill-0": "prefill", "pd-decode-0": "decode"}
        assert workers["pd-decode-0"]["labels"]["kv_connector"] == "NixlConnector"  # the sim speaks NIXL's protocol
        model = fleet.fleet()["models"][0]
        assert [(p["role"], p["desired_replicas"]) for p in model["pools"]] == [("prefill", 1), ("decode", 1)]
        status = cli("status", "--proxy", fleet.url)
        assert status.returncode == 0, status.stderr
        assert "prefill 1/1, decode 1/1" in status.stdout and "role" in status.stdout
        assert any(line.split()[:3] == ["pd-decode-0", "ready", "decode"] for line in status.stdout.splitlines())

        with SteadyLoad(fleet.url, "pd", concurrency=3) as load:
            wait_until(lambda: load.result.ok >= 10, 60, what="load to flow")
            refused = cli("scale", "pd", "2", "--proxy", fleet.url)
            assert refused.returncode == 1 and "say which one to scale" in refused.stderr
            scaled = cli("scale", "pd", "2", "--role", "decode", "--proxy", fleet.url)
            assert scaled.returncode == 0, scaled.stderr
            assert "decode: scale 1 -> 2" in scaled.stdout and "prefill: unchanged" in scaled.stdout
            fleet.wait_workers({"pd-prefill-0", "pd-decode-0", "pd-decode-1"})
            wait_until(lambda: "pd-decode-1" in load.result.by_worker, 60, what="the new decode worker to serve")
            fleet.write_config(CONFIG.format(decode=1))  # and back down by editing the file
            fleet.wait_workers({"pd-prefill-0", "pd-decode-0"})
            served = load.result.ok
            wait_until(lambda: load.result.ok >= served + 10, 60, what="load to go on")
        result = load.stop()
        assert result.failures == [], f"{len(result.failures)} failed requests, e.g. {result.failures[:3]}"
        metrics = httpx.get(f"{fleet.url}/metrics", headers=fleet.headers, timeout=5).text
        assert 'kvroute:fleet_pool_desired_replicas{model="pd",role="decode"} 1.0' in metrics
        assert 'kvroute:worker_role{role="prefill",worker="pd-prefill-0"} 1.0' in metrics
    finally:
        fleet.proc.stop()
        fleet.kill_leftovers()
