"""placement: ray on a local Ray cluster that the test starts itself: each replica is an actor holding
its share of a custom resource that stands in for GPUs, and its sim worker registers and serves."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.fleet.support import Fleet, pid_alive
from tests.support.procs import free_port, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

RAY = str(Path(sys.executable).with_name("ray"))


def _cmdline_pids(needle: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _listening_or_dead(head, port: int) -> bool:
    """True once the Ray head listens on `port`, or has exited (then waiting longer is pointless)."""
    if not head.alive():
        return True
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def ray_cluster(procs, monkeypatch):
    """A one-node Ray cluster with 4 `fake_gpu`, every port free-picked; stopped by PID at the end."""
    if not Path(RAY).exists():
        pytest.fail("ray is not installed: run `make test` (it installs the `ray` extra)")
    # Ray swaps 127.0.0.1 for the machine's network address unless clusters are "unsupported" (its
    # single-machine mode, as on macOS); tests keep all traffic, Ray's own included, on loopback.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray puts unix sockets under its temp dir: keep the path short.
    temp_dir = tempfile.mkdtemp(prefix="kvr-ray-", dir="/tmp")
    head = None
    for _attempt in range(3):  # a free-picked port can be taken again before Ray binds it: retry
        port = free_port()
        ports = {flag: str(free_port()) for flag in (
            "--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
            "--node-manager-port", "--object-manager-port")}
        low = free_port()
        head = procs.start([RAY, "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
                            "--num-cpus", "2", "--num-gpus", "0", "--resources", json.dumps({"fake_gpu": 4}),
                            "--include-dashboard", "false", "--temp-dir", temp_dir, "--disable-usage-stats",
                            "--min-worker-port", str(low), "--max-worker-port", str(low + 20),
                            *[x for kv in ports.items() for x in kv]], name="ray-head")

        wait_until(lambda h=head, p=port: _listening_or_dead(h, p), 120, 0.2, "the Ray head to listen")
        if head.alive():
            break
    try:
        assert head is not None and head.alive(), f"the Ray head did not start:\n{head.log()[-3000:] if head else ''}"
        yield f"127.0.0.1:{port}"
    finally:
        # Ray's graceful stop takes long on 2 cores and nothing here needs it; procs also stops every head
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        for pid in _cmdline_pids(temp_dir):  # Ray workers that left the group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_placement_runs_each_replica_as_an_actor_holding_its_gpus(procs, tmp_path, ray_cluster):
    config = f"""
        proxy:
          drain_grace_s: 10
        state:
          url: memory
          ray_address: "{ray_cluster}"
          ray_gpu_resource: fake_gpu
        models:
          - name: tiny
            engine: sim
            preset: cpu-tiny
            device: cpu
            placement: ray
            replicas: 2
            gpus_per_replica: 2
            startup_timeout_s: 120
        """
    fleet = Fleet(procs, tmp_path, config)
    try:
        fleet.wait_workers({"tiny-0", "tiny-1"}, timeout=150)
        replicas = fleet.fleet()["replicas"]
        assert {r["placement"] for r in replicas} == {"ray"}
        assert [r["gpus"] for r in replicas] == [["2 fake_gpu"], ["2 fake_gpu"]]
        # Each worker registered at its node's address (the actor's Ray node, loopback in this test).
        workers = fleet.workers()
        for r in replicas:
            assert workers[r["worker_id"]]["url"] == r["url"] and r["url"].startswith(f"http://{r['node']}:")
        served = set()
        for n in range(20):
            resp = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=30,
                              json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f"q{n}"}]})
            assert resp.status_code == 200, resp.text
            served.add(resp.headers["x-kvroute-worker"])
        assert served <= {"tiny-0", "tiny-1"} and served

        pids = {r["pid"] for r in replicas}
        os.kill(fleet.proc.pid, signal.SIGTERM)
        assert fleet.proc.popen.wait(60) == 0
        wait_until(lambda: not any(pid_alive(p) for p in pids), 20, what="actor-hosted workers to exit")
    finally:
        fleet.proc.stop()
        fleet.kill_leftovers()

