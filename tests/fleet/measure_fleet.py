"""Timings of `kvroute up` on sim workers (not a test: figures for reports, no assertions on speed).

Run: .venv/bin/python -m tests.fleet.measure_fleet [--replicas 4]
Prints: start -> all ready, scale +N -> ready, SIGKILL -> serving again, scale to 1 -> drained, stop -> exited.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx

from tests.fleet.support import Fleet, sim_model
from tests.support.procs import ProcessGroup, wait_until

HEAD = """
    proxy:
      drain_grace_s: 20
    models:"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-measure-"))
    group = ProcessGroup(tmp)
    try:
        t0 = time.monotonic()
        fleet = Fleet(group, tmp, HEAD + sim_model("tiny", 2))
        fleet.wait_workers(2)
        print(f"kvroute up -> 2 workers ready: {time.monotonic() - t0:.2f}s")

        t0 = time.monotonic()
        httpx.post(f"{fleet.url}/fleet/scale", json={"model": "tiny", "replicas": args.replicas}, timeout=10)
        fleet.wait_workers(args.replicas)
        print(f"scale 2 -> {args.replicas} -> all ready: {time.monotonic() - t0:.2f}s")

        victim = fleet.fleet()["replicas"][0]
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)

        def back() -> bool:
            (r,) = [x for x in fleet.fleet()["replicas"] if x["worker_id"] == victim["worker_id"]]
            return r["pid"] != victim["pid"] and r["state"] == "ready"
        wait_until(back, 60, 0.05, "the killed worker to be ready again")
        print(f"SIGKILL -> {victim['worker_id']} ready again (backoff 0.2s): {time.monotonic() - t0:.2f}s")

        t0 = time.monotonic()
        httpx.post(f"{fleet.url}/fleet/scale", json={"model": "tiny", "replicas": 1}, timeout=10)
        fleet.wait_workers(1)
        print(f"scale {args.replicas} -> 1 -> drained and gone (idle workers): {time.monotonic() - t0:.2f}s")

        t0 = time.monotonic()
        os.kill(fleet.proc.pid, signal.SIGTERM)
        fleet.proc.popen.wait(60)
        print(f"SIGTERM -> kvroute up exited, workers stopped: {time.monotonic() - t0:.2f}s")
    finally:
        group.stop_all()


if __name__ == "__main__":
    main()
