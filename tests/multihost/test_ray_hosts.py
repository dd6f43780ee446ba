"""placement: ray across three machines: a Ray head beside `kvroute up` on A, Ray nodes on B and C, sim
replicas placed on B and C that register at their own addresses and serve a client on D; `kvroute scale`
moves the fleet between hosts while that client sees no failed request."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.multihost.support import ADMIN, ADMIN_TOKEN, PROXY_PORT, WORKER_TOKEN
from tests.support.procs import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

RAY = str(Path(sys.executable).with_name("ray"))
RAY_PORT = 6380
# Ray on a 2-core box: one CPU per node, a small object store, no dashboard.
RAY_NODE = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(80 * 1024 * 1024),
            "--disable-usage-stats", "--block"]


def _start_ray(hosts, temp: Path, head_address: str | None, resources: dict[str, int]) -> None:
    """`ray start` on each host at once, retried: Ray gives a node 30 s to register, which a busy 2-core
    box can miss."""
    def argv(host) -> list[str]:
        args = [RAY, "start", "--node-ip-address", host.address, "--temp-dir", str(temp / host.name),
                "--resources", json.dumps(resources), *RAY_NODE]
        return args + (["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"] if head_address is None
                       else ["--address", head_address])

    pending = list(hosts)
    for _attempt in range(3):
        procs = {host.name: host.start(argv(host), name="ray") for host in pending}
        wait_until(lambda ps=procs: all("Ray runtime started" in p.log() or not p.alive() for p in ps.values()), 150,
                   0.5, "Ray to start on " + ", ".join(procs))
        pending = [host for host in pending if not procs[host.name].alive()]
        if not pending:
            return
    raise AssertionError("Ray did not start on " + ", ".join(h.name for h in pending))


def _fleet(a) -> list[dict]:
    return httpx.get(f"{a.url(PROXY_PORT)}/fleet", headers=ADMIN, timeout=5).json()["replicas"]


def _ready_workers(a) -> dict[str, str]:
    body = httpx.get(f"{a.url(PROXY_PORT)}/workers", headers=ADMIN, timeout=5).json()
    return {w["worker_id"]: w["url"] for w in body["workers"] if w["state"] == "ready"}


def _progress(out: Path) -> dict:
    try:
        return json.loads(Path(str(out) + ".progress").read_text())
    except (OSError, ValueError):
        return {"served": {}, "failed": 0}


def test_ray_places_replicas_on_other_hosts_that_serve_a_client_on_a_fourth(net, tmp_path):
    a, b, c, d = net["a"], net["b"], net["c"], net["d"]
    temp = Path(tempfile.mkdtemp(prefix="kvr-rayh-", dir="/tmp"))  # short: Ray puts unix sockets there
    try:
        _start_ray([a], temp, None, {})
        head = f"{a.address}:{RAY_PORT}"
        # One fake GPU per worker host: each replica holds one, so the two land on B and C.
        _start_ray([b, c], temp, head, {"fake_gpu": 1})

        config = tmp_path / "fleet.yaml"
        config.write_text(f"""
proxy:
  admin_token: {ADMIN_TOKEN}
  worker_token: {WORKER_TOKEN}
  drain_grace_s: 5
state:
  url: memory
  ray_address: "{head}"
  ray_gpu_resource: fake_gpu
models:
  - name: tiny
    engine: sim
    preset: cpu-tiny
    device: cpu
    placement: ray
    replicas: 2
    gpus_per_replica: 1
    startup_timeout_s: 120
    engine_args: {{time-scale: 20}}
""")
        up = a.kvroute("up", str(config), "--host", "0.0.0.0", "--port", str(PROXY_PORT), "--no-watch",
                       "--run-dir", str(tmp_path / "run"), name="up")
        wait_until(lambda: len(_ready_workers(a)) == 2 or not up.alive(), 180, 0.5, "two replicas ready")
        assert up.alive(), up.log()[-3000:]
        placed = {r["worker_id"]: r["node"] for r in _fleet(a)}
        assert sorted(placed.values()) == [b.address, c.address], placed
        urls = _ready_workers(a)
        for wid, node in placed.items():  # each registered at its own host's address, not 127.0.0.1/0.0.0.0
            assert urls[wid].startswith(f"http://{node}:"), urls

        stop, out = tmp_path / "stop-client", tmp_path / "client.json"
        client = d.start([sys.executable, "-m", "tests.multihost.client", a.url(PROXY_PORT), "--stop", str(stop),
                          "--out", str(out), "--concurrency", "4"], name="client")
        wait_until(lambda: set(_progress(out)["served"]) == set(placed), 60, 0.2, "the client on D served by B and C")

        # Scale to one replica: one host drains; then back to two: the freed host gets a new replica.
        scale = [sys.executable, "-m", "proxy.cli", "scale", "tiny"]
        env_token = ["--proxy", a.url(PROXY_PORT), "--token", ADMIN_TOKEN]
        assert a.run([*scale, "1", *env_token]).returncode == 0
        wait_until(lambda: len(_fleet(a)) == 1 and len(_ready_workers(a)) == 1, 60, 0.3, "one replica left")
        left = next(iter(_ready_workers(a)))
        freed = ({b.address, c.address} - {placed.get(left)}).pop()
        before = dict(_progress(out)["served"])
        wait_until(lambda: _progress(out)["served"].get(left, 0) >= before.get(left, 0) + 20, 60, 0.2,
                   "the last replica to serve alone")
        assert a.run([*scale, "2", *env_token]).returncode == 0
        wait_until(lambda: len(_ready_workers(a)) == 2, 120, 0.5, "a second replica again")
        nodes = {r["worker_id"]: r["node"] for r in _fleet(a)}
        new = (set(nodes) - {left}).pop()
        assert nodes[new] == freed, nodes
        wait_until(lambda: _progress(out)["served"].get(new, 0) > 0, 60, 0.2, "the new replica to serve D")

        stop.touch()
        assert client.popen.wait(60) == 0, client.log()[-2000:]
        result = json.loads(out.read_text())
        print(f"\n[ray] client on D: served {result['served']}, failed {result['failed']}")
        assert result["failed"] == 0, result["failures"]
        assert set(result["served"]) == {*placed, new}
    finally:
        for host in (a, b, c):  # Ray's graceful stop takes seconds per node; nothing here needs it
            host.kill_all()
        shutil.rmtree(temp, ignore_errors=True)
