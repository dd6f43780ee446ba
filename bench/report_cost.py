"""What load reports cost the proxy: its CPU with an idle fleet of sim workers reporting at two intervals.

Owns this one measurement, the figure behind protocol.REPORTS_PER_S. A real `kvroute proxy` (through
bench/ablate.py, to set the interval it asks for) and N `kvroute worker --engine sim` processes, no
traffic: the proxy's CPU over a window is its idle loops plus the reports it takes. Cells alternate between
the intervals, `--repeats` times each; the marginal cost of one report is the CPU difference between the two
intervals over the difference in reports per second. Run: `python -m bench.report_cost` (~3 min).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

from bench.procstat import ProcessTree
from bench.report import environment_note, results_path, write_json
from bench.sim_vs_vllm_cpu import REPO, _free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--intervals", default="0.25,0.05", help="report intervals the proxy asks for, comma-separated")
    p.add_argument("--window-s", type=float, default=15.0, help="measured seconds per cell (default 15)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="report-cost")


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def one_cell(interval: float, workers: int, window_s: float) -> float:
    """The proxy's CPU as a share of one core over `window_s`, with `workers` idle sims reporting."""
    port = _free_port()
    proxy = _start([sys.executable, "-m", "bench.ablate", f"proxy.protocol.REPORT_INTERVAL_S={interval}",
                    f"proxy.protocol.REPORT_INTERVAL_MAX_S={max(interval, 0.25)}", "--", "proxy", "--port", str(port),
                    "--log-level", "warning"])
    procs = [proxy]
    try:
        procs += [_start([sys.executable, "-m", "proxy.cli", "worker", "--engine", "sim", "--port", "0",
                          "--proxy-url", f"http://127.0.0.1:{port}", "--served-model-name", "m",
                          "--worker-id", f"sim-{i}", "--log-level", "warning"]) for i in range(workers)]
        deadline = time.monotonic() + 60
        while True:
            try:
                if len(httpx.get(f"http://127.0.0.1:{port}/workers", timeout=1).json()["workers"]) == workers:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not all register within 60 s")
            time.sleep(0.5)
        time.sleep(2.0)  # every worker has its interval and the startup work is over
        tree = ProcessTree(proxy.pid)
        cpu0, t0 = tree.cpu_seconds(), time.monotonic()
        time.sleep(window_s)
        return (tree.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    finally:
        _stop(procs)


def run(args: argparse.Namespace) -> int:
    intervals = [float(x) for x in args.intervals.split(",")]
    shares: dict[float, list[float]] = {iv: [] for iv in intervals}
    for rep in range(args.repeats):
        for iv in intervals:
            shares[iv].append(one_cell(iv, args.workers, args.window_s))
            print(f"[report-cost] #{rep} interval {iv:g} s: proxy CPU {shares[iv][-1]:.1%} of a core", flush=True)
    slow, fast = max(intervals), min(intervals)
    per_s = {iv: args.workers / iv for iv in intervals}
    marginal_us = [(f - s) / (per_s[fast] - per_s[slow]) * 1e6 for f, s in zip(shares[fast], shares[slow], strict=True)]
    lines = ["# Load reports: what they cost the proxy", "",
             f"{environment_note()}. Command: `python -m bench.report_cost {' '.join(sys.argv[1:])}`", "",
             f"{args.workers} idle sim workers, no traffic, {args.window_s:g} s windows, {args.repeats} repeats "
             "alternating between the intervals; mean (min-max).", "",
             "| report interval | reports/s | proxy CPU, share of a core |", "|---|---|---|"]
    for iv in intervals:
        xs = shares[iv]
        lines.append(f"| {iv:g} s | {per_s[iv]:.0f} | {statistics.mean(xs):.1%} ({min(xs):.1%}-{max(xs):.1%}) |")
    lines += ["", f"Marginal cost of one report (CPU difference over report-rate difference, per repeat): "
              f"{statistics.mean(marginal_us):.0f} us ({min(marginal_us):.0f}-{max(marginal_us):.0f})."]
    text = "\n".join(lines) + "\n"
    results_path(args.name, ".md").write_text(text)
    write_json(results_path(args.name, ".json"), {"workers": args.workers, "shares": {str(k): v for k, v in shares.items()},
                                                  "marginal_us": marginal_us})
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
