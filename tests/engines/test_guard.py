"""No engine process outlives its supervisor: the guard takes the engine's whole process tree down.

A stand-in engine (a Python process with a helper child, like vLLM's API server and EngineCore)
runs under the same `spawn_guarded` the supervisor uses, so these run in a second.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.procs import wait_until

# The fake engine: prints its pid and its helper's pid, then waits to be killed.
FAKE_ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"engine={__import__('os').getpid()} helper={helper.pid}", flush=True)
    time.sleep(600)
""")
# A minimal supervisor: spawns the fake engine under the guard and relays its output.
SUPERVISOR = textwrap.dedent(f"""
    import asyncio, os, sys
    from backends.worker import spawn_guarded
    async def main():
        guard = await spawn_guarded([sys.executable, "-c", {FAKE_ENGINE!r}], dict(os.environ), 2.0)
        print(f"guard={{guard.pid}}", flush=True)
        while line := await guard.stdout.readline():
            print(line.decode(), end="", flush=True)
        print(f"guard exited {{await guard.wait()}}", flush=True)
    asyncio.run(main())
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def start_tree(procs) -> tuple[object, dict[str, int]]:
    sup = procs.start([sys.executable, "-c", SUPERVISOR], name="supervisor")
    pids = wait_until(lambda: dict((k, int(v)) for k, v in re.findall(r"(guard|engine|helper)=(\d+)", sup.log()))
                      if "helper=" in sup.log() else None, 20, what="the fake engine to start")
    return sup, pids


@pytest.mark.timeout(60)
def test_sigkilled_supervisor_leaves_no_engine_process(procs):
    sup, pids = start_tree(procs)
    assert all(alive(p) for p in pids.values())
    os.kill(sup.pid, signal.SIGKILL)
    wait_until(lambda: not any(alive(p) for p in pids.values()), 10, what="guard, engine and helper to exit")


@pytest.mark.timeout(60)
def test_engine_killed_takes_its_helpers_and_the_guard_reports_it(procs):
    sup, pids = start_tree(procs)
    os.kill(pids["engine"], signal.SIGKILL)
    wait_until(lambda: "guard exited" in sup.log(), 10, what="the supervisor to see the guard exit")
    assert "guard exited 137" in sup.log()  # 128 + SIGKILL: a crash, not a clean stop
    wait_until(lambda: not alive(pids["helper"]), 5, what="the engine's helper to be killed")


@pytest.mark.timeout(60)
def test_stop_request_reaches_the_engine_group(procs):
    sup, pids = start_tree(procs)
    os.kill(pids["guard"], signal.SIGTERM)
    wait_until(lambda: "guard exited" in sup.log(), 10, what="the guard to stop the engine")
    assert not alive(pids["engine"]) and not alive(pids["helper"])
