"""Supervision of real worker processes: crash -> restart with backoff, crash loop -> failed,
stop -> the whole process group is gone (engine children included)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from proxy.config import ModelConfig
from proxy.fleet.launcher import WorkerLaunch
from proxy.fleet.placement.local import LocalPlacement
from proxy.fleet.supervisor import BACKOFF, FAILED, STARTING, STOPPED, Replica, RestartPolicy

pytestmark = pytest.mark.timeout(60)


class ScriptPlacement(LocalPlacement):
    """Local placement whose 'worker' is a Python snippet (the real worker is tested in test_up.py)."""

    def __init__(self, run_dir: Path, script: str) -> None:
        super().__init__(run_dir)
        self.script = textwrap.dedent(script)

    def command(self, launch, port, url):
        return [sys.executable, "-c", self.script, str(port)]


def make_replica(tmp_path: Path, script: str, policy: RestartPolicy) -> Replica:
    launch = WorkerLaunch(worker_id="m-0", model=ModelConfig(name="m", engine="sim"), proxy_url="http://127.0.0.1:9")
    return Replica(launch, 0, 0, "fp", ScriptPlacement(tmp_path, script), policy)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_crash_loop_ends_in_failed_after_backing_off(tmp_path):
    replica = make_replica(tmp_path, "import sys; sys.exit(3)",
                           RestartPolicy(backoff_s=0.05, crash_loop_count=4, crash_loop_window_s=60))
    replica.start()
    await until(lambda: replica.state == FAILED, 30, "the crash loop to end in failed")
    assert replica.restarts == 3
    assert replica.last_exit_code == 3
    assert "crash loop: 4 crashes" in replica.last_error
    await replica.stop(1)


async def test_crashed_worker_is_restarted_with_growing_delay(tmp_path):
    marker = tmp_path / "starts"
    script = f"""
        import sys, time
        with open({str(marker)!r}, "a") as f: f.write(f"{{time.monotonic()}}\\n")
        time.sleep(0.2)
        sys.exit(1)
    """
    replica = make_replica(tmp_path, script, RestartPolicy(backoff_s=0.3, crash_loop_count=10))
    replica.start()
    await until(lambda: marker.exists() and len(marker.read_text().split()) >= 3, 30, "three starts")
    starts = [float(x) for x in marker.read_text().split()]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # Each gap is the 0.2 s run plus the backoff, which doubles: 0.3 s, then 0.6 s.
    assert gaps[0] >= 0.5 and gaps[1] >= 0.8
    assert replica.state in (STARTING, BACKOFF)
    await replica.stop(1)
    assert replica.state == STOPPED


async def test_stop_terminates_worker_then_its_whole_group(tmp_path):
    child_pid_file = tmp_path / "child.pid"
    # The "worker" starts an "engine" child that ignores SIGTERM, as a wedged engine would.
    script = f"""
        import signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        open({str(child_pid_file)!r}, "w").write(str(child.pid))
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        time.sleep(600)
    """
    replica = make_replica(tmp_path, script, RestartPolicy())
    replica.start()
    await until(lambda: child_pid_file.exists() and child_pid_file.read_text(), 20, "the engine child")
    worker_pid, child_pid = replica.handle.pid, int(child_pid_file.read_text())
    try:
        assert pid_alive(worker_pid) and pid_alive(child_pid)
        await replica.stop(grace_s=1)
        assert replica.state == STOPPED
        await until(lambda: not pid_alive(worker_pid) and not pid_alive(child_pid), 5, "no process left")
        assert replica.restarts == 0  # a stop is not a crash
    finally:
        for pid in (worker_pid, child_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
