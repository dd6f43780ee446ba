"""`kvroute up` end to end on sim workers: scaling under load without a failed request, crash recovery,
crash loops, config edits, GPU assignment and a clean stop. Real processes, real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap

import httpx
import pytest

from tests.fleet.support import Fleet, SteadyLoad, pid_alive, processes_in_groups, sim_model
from tests.support.procs import KVROUTE, wait_until

pytestmark = pytest.mark.timeout(240)

HEAD = """
    proxy:
      drain_grace_s: 20
    models:"""


@pytest.fixture
def fleets(procs, tmp_path):
    """Start `kvroute up` with `fleets(config)`; whatever it started is checked and stopped at the end."""
    started: list[Fleet] = []

    def start(config: str, *extra: str, env: dict[str, str] | None = None, token: str | None = None) -> Fleet:
        fleet = Fleet(procs, tmp_path, config, *extra, env=env, token=token)
        started.append(fleet)
        return fleet

    yield start
    for fleet in started:
        fleet.proc.stop()
        fleet.kill_leftovers()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=60)


def test_scale_2_to_4_to_1_under_load_fails_no_request(fleets):
    fleet = fleets(HEAD + sim_model("tiny", 2))
    assert fleet.wait_workers({"tiny-0", "tiny-1"}) == {"tiny-0", "tiny-1"}
    with SteadyLoad(fleet.url, "tiny", concurrency=4) as load:
        wait_until(lambda: load.result.ok >= 10, 60, what="load to flow")

        scaled = cli("scale", "tiny", "4", "--proxy", fleet.url)
        assert scaled.returncode == 0, scaled.stderr
        assert "scale 2 -> 4" in scaled.stdout
        fleet.wait_workers({"tiny-0", "tiny-1", "tiny-2", "tiny-3"})
        # The new workers take traffic, not just register.
        wait_until(lambda: {"tiny-2", "tiny-3"} <= set(load.result.by_worker), 60, what="new workers to serve")

        fleet.write_config(HEAD + sim_model("tiny", 1))
        applied = cli("apply", str(fleet.config_path), "--proxy", fleet.url)
        assert applied.returncode == 0, applied.stderr
        fleet.wait_workers({"tiny-0"})
        served_before = load.result.ok
        wait_until(lambda: load.result.ok >= served_before + 10, 60, what="load to go on with one worker")
    result = load.stop()
    assert result.failures == [], f"{len(result.failures)} failed requests, e.g. {result.failures[:3]}"
    assert result.ok >= 30
    replicas = fleet.fleet()["replicas"]
    assert [r["worker_id"] for r in replicas] == ["tiny-0"] and replicas[0]["state"] == "ready"


def test_sigkilled_worker_is_back_and_serving_and_a_crash_loop_ends_failed(fleets):
    config = HEAD + sim_model("tiny", 1) + sim_model("broken", 1, extra=", no-such-flag: 1")
    fleet = fleets(config, "--crash-loop-count", "3")
    fleet.wait_workers({"tiny-0"})
    (before,) = [r for r in fleet.fleet()["replicas"] if r["worker_id"] == "tiny-0"]

    os.kill(before["pid"], signal.SIGKILL)

    def serving_again() -> bool:
        r = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=10,
                       json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        (now,) = [x for x in fleet.fleet()["replicas"] if x["worker_id"] == "tiny-0"]
        ok = r.status_code == 200 and now["pid"] != before["pid"] and now["restarts"] == 1 and now["state"] == "ready"
        return now if ok else None
    now = wait_until(serving_again, 30, 0.2, "the killed worker to be back and serving")
    # Ready means the new process registered, not that the dead one's entry lingers in the proxy.
    assert fleet.workers()["tiny-0"]["url"] == now["url"]

    # A worker that cannot start (a bad engine flag) is retried with backoff, then marked failed.
    def broken_failed() -> dict | None:
        (b,) = [x for x in fleet.fleet()["replicas"] if x["model"] == "broken"]
        return b if b["state"] == "failed" else None
    broken = wait_until(broken_failed, 60, 0.2, "the crash loop to end in failed")
    assert broken["restarts"] == 2 and "crash loop" in broken["last_error"]
    metrics = httpx.get(f"{fleet.url}/metrics", timeout=5).text
    assert 'kvroute:fleet_replicas{model="broken",state="failed"} 1.0' in metrics
    assert 'kvroute:fleet_restarts_total{model="tiny"} 1.0' in metrics
    status = cli("status", "--proxy", fleet.url)
    assert status.returncode == 0, status.stderr
    assert "broken-0" in status.stdout and "failed" in status.stdout
    assert "tiny-0" in status.stdout and "ready" in status.stdout


def test_config_edits_are_followed_without_a_restart(fleets):
    fleet = fleets(HEAD + sim_model("tiny", 1))
    fleet.wait_workers({"tiny-0"})
    up_pid = fleet.proc.pid

    # More replicas, and a new model whose alias works as soon as its worker is ready.
    fleet.write_config(HEAD + sim_model("tiny", 2) + sim_model("second", 1, extra="") + "\n        aliases: [alias2]")
    fleet.wait_workers({"tiny-0", "tiny-1", "second-0"})
    resp = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=30,
                      json={"model": "alias2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvroute-worker"] == "second-0"

    # A broken edit is reported with its line and ignored: the fleet keeps running as it was.
    fleet.write_config(HEAD + sim_model("tiny", 2).replace("replicas: 2", "replicas: -1"))
    wait_until(lambda: "models[0].replicas (line" in fleet.proc.log(), 20, what="the bad edit to be reported")
    assert fleet.ready_ids() == {"tiny-0", "tiny-1", "second-0"}

    # New engine args: a rolling restart, each replacement ready before its old replica drains;
    # the model that left the file is drained away.
    with SteadyLoad(fleet.url, "tiny", concurrency=3) as load:
        fleet.write_config(HEAD + sim_model("tiny", 2, time_scale=2))
        fleet.wait_workers({"tiny-0-g1", "tiny-1-g1"}, timeout=90)
    result = load.stop()
    assert result.failures == [], f"{len(result.failures)} failed requests, e.g. {result.failures[:3]}"
    assert fleet.proc.alive() and fleet.proc.pid == up_pid


def test_gpus_are_assigned_and_stop_leaves_no_process(fleets):
    fleet = fleets(HEAD + sim_model("tp2", 2, gpus=2), env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    fleet.wait_workers({"tp2-0", "tp2-1"})
    replicas = {r["worker_id"]: r for r in fleet.fleet()["replicas"]}
    assert sorted(r["gpus"] for r in replicas.values()) == [["0", "1"], ["2", "3"]]
    for r in replicas.values():  # what the worker process really got
        with open(f"/proc/{r['pid']}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env[b"CUDA_VISIBLE_DEVICES"].decode() == ",".join(r["gpus"])

    too_many = cli("scale", "tp2", "3", "--proxy", fleet.url)  # 6 GPUs wanted, 4 visible
    assert too_many.returncode == 1 and "needs 6 GPUs (tp2: 3 x 2) but 4 are available" in too_many.stderr
    assert len(fleet.fleet()["replicas"]) == 2

    pids = {r["pid"] for r in replicas.values()}
    os.kill(fleet.proc.pid, signal.SIGTERM)  # as Ctrl-C / systemd would
    assert fleet.proc.popen.wait(60) == 0
    assert "kvroute up: stopped" in fleet.proc.log()
    assert [p for p in pids if pid_alive(p)] == []
    assert processes_in_groups(pids) == []  # nothing the workers started is left either


def test_admin_token_guards_the_fleet_and_sigkilled_up_takes_its_workers_with_it(fleets):
    head = HEAD.replace("drain_grace_s: 20", "drain_grace_s: 20\n      admin_token: ${TEST_ADMIN_TOKEN}")
    fleet = fleets(head + sim_model("tiny", 2), env={"TEST_ADMIN_TOKEN": "s3cret"}, token="s3cret")
    fleet.wait_workers({"tiny-0", "tiny-1"})  # the workers got a token the proxy accepts
    assert cli("status", "--proxy", fleet.url).returncode == 0  # reading, on this machine: no token needed
    denied = cli("scale", "tiny", "3", "--proxy", fleet.url)
    assert denied.returncode == 1 and "admin token" in denied.stderr
    allowed = cli("status", "--proxy", fleet.url, "--token", "s3cret")
    assert allowed.returncode == 0 and "tiny-1" in allowed.stdout

    pids = {r["pid"] for r in fleet.fleet()["replicas"]}
    os.kill(fleet.proc.pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 30, what="orphaned workers to exit")


def test_a_fleet_that_does_not_fit_is_refused_before_anything_starts(tmp_path):
    cfg = tmp_path / "big.yaml"
    cfg.write_text(textwrap.dedent(HEAD + sim_model("big", 3, gpus=2)))
    out = subprocess.run([*KVROUTE, "up", str(cfg), "--port", "0"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert out.returncode == 2
    assert "needs 6 GPUs (big: 3 x 2) but 4 are available" in out.stderr
    assert "listening" not in out.stdout


def test_a_bad_config_names_key_path_and_line(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("models:\n  - name: a\n    engine: sim\n    replicas: many\n")
    out = subprocess.run([*KVROUTE, "up", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "models[0].replicas (line 4)" in out.stderr


def test_rolling_restart_without_spare_gpus_restarts_in_place_on_the_same_gpus(fleets):
    fleet = fleets(HEAD + sim_model("t", 2, gpus=1), env={"CUDA_VISIBLE_DEVICES": "0,1"})
    fleet.wait_workers({"t-0", "t-1"})
    old_pids = {r["pid"] for r in fleet.fleet()["replicas"]}
    fleet.write_config(HEAD + sim_model("t", 2, gpus=1, time_scale=2))

    def restarted() -> dict | None:
        body = fleet.fleet()
        want = body["models"][0]["fingerprint"]
        rs = body["replicas"]
        done = (len(rs) == 2 and all(r["fingerprint"] == want and r["state"] == "ready" for r in rs)
                and not {r["pid"] for r in rs} & old_pids)
        return body if done else None
    body = wait_until(restarted, 90, 0.2, "both replicas to run the new spec")
    assert sorted(r["gpus"] for r in body["replicas"]) == [["0"], ["1"]]  # never two replicas on one GPU
    assert sorted(r["worker_id"] for r in body["replicas"]) == ["t-0", "t-1"]  # in place: same ids
    log = (fleet.run_dir / "kvroute-up.log").read_text()  # info lines go to the log file, not the terminal
    assert "no spare GPUs to start its replacement first" in log and "proxy settings changed" not in log
    # One at a time: t-1 was stopped only after the new t-0 was ready.
    assert log.index("t-0: ready", log.index("stopped t-0")) < log.index("stopped t-1")
