"""Benchmark: TTFT and throughput of one sim worker against offered load (open-loop Poisson arrivals).

Owns starting one `kvroute worker --engine sim`, the rate sweep and the markdown table; request
timing is bench/loadgen.py's. Times are converted back to simulated seconds (wall x time scale).

    .venv/bin/python -m bench.sim_curve --preset h100-qwen3-vl-8b --rates 2,4,8,12,16,20,24
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import random
import re
import signal
import string
import sys
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen import LoadGenerator, RequestSpec, chat_body, percentile, poisson_arrivals

LISTENING = re.compile(rb"kvroute-sim listening on (http://\S+)")


def words(count: int, rng: random.Random) -> str:
    """Random five-letter words: about one token each by the sim's text rule, no shared prefixes."""
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(count))


async def start_worker(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    cmd = [sys.executable, "-m", "proxy.cli", "worker", "--engine", "sim", "--host", "127.0.0.1", "--port", "0",
           "--preset", args.preset, "--served-model-name", "sim", "--time-scale", str(args.time_scale),
           "--log-level", "warning"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
    match = LISTENING.search(line)
    if not match:
        proc.kill()
        raise RuntimeError(f"sim worker did not start: {line!r}")
    return proc, match.group(1).decode()


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as resp:
        return await resp.json()


async def run_rate(url: str, rate: float, args: argparse.Namespace, session: aiohttp.ClientSession) -> dict[str, Any]:
    """One open-loop run at `rate` simulated requests/s; returns the row of the table."""
    scale = args.time_scale
    count = max(10, int(rate * args.duration_s))
    rng = random.Random(f"{args.seed}-{rate}")
    arrivals = poisson_arrivals(rate * scale, count, seed=args.seed)  # wall-clock offsets
    specs = [RequestSpec(chat_body("sim", [{"role": "user", "content": words(args.prompt_words, rng)}],
                                   args.max_tokens, stream=True), arrival_s=t) for t in arrivals]
    before = await get_json(session, f"{url}/sim/state")
    peaks = {"kv": 0.0, "waiting": 0, "running": 0}
    progress: list[tuple[float, int]] = []  # (simulated time, tokens generated so far)
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            state = await get_json(session, f"{url}/sim/state")
            peaks["kv"] = max(peaks["kv"], state["kv_cache_usage"])
            peaks["waiting"] = max(peaks["waiting"], state["num_waiting"])
            peaks["running"] = max(peaks["running"], state["num_running"])
            progress.append((state["sim_time_s"], state["generated_tokens"]))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 0.2)

    sampler = asyncio.create_task(sample())
    run = await LoadGenerator(url, timeout_s=600).open_loop(specs)
    done.set()
    await sampler
    after = await get_json(session, f"{url}/sim/state")
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft_s * scale for r in ok if r.ttft_s is not None]
    e2e = [r.latency_s * scale for r in ok]
    sim_span = run.wall_s * scale
    sim_busy = after["busy_sim_s"] - before["busy_sim_s"]
    # steady state: tokens generated while requests were still arriving (the tail is left out)
    window_start, window_end = before["sim_time_s"] + arrivals[0] * scale, before["sim_time_s"] + arrivals[-1] * scale
    in_window = [p for p in progress if window_start <= p[0] <= window_end]
    window_tps = ((in_window[-1][1] - in_window[0][1]) / (in_window[-1][0] - in_window[0][0])
                  if len(in_window) >= 2 and in_window[-1][0] > in_window[0][0] else None)
    return {
        "offered": rate, "requests": len(specs), "ok": len(ok),
        "done_rps": len(ok) / sim_span, "out_tps": sum(r.completion_tokens for r in ok) / sim_span,
        "window_tps": window_tps,
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "e2e_p50": percentile(e2e, 50),
        "peak_kv": peaks["kv"], "peak_running": peaks["running"], "peak_waiting": peaks["waiting"],
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "lag_frac": (after["lag_sim_s"] - before["lag_sim_s"]) / max(sim_busy, 1e-9),
    }


async def wait_idle(url: str, session: aiohttp.ClientSession) -> None:
    while True:
        state = await get_json(session, f"{url}/sim/state")
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            return
        await asyncio.sleep(0.2)


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, state: dict[str, Any]) -> str:
    lines = [
        f"# sim curve: {args.preset}, TTFT and throughput against offered load",
        "",
        f"Measured {datetime.date.today().isoformat()} with `.venv/bin/python -m bench.sim_curve --preset {args.preset} "
        f"--rates {args.rates} --duration-s {args.duration_s} --prompt-words {args.prompt_words} "
        f"--max-tokens {args.max_tokens} --time-scale {args.time_scale}` on a 2-core CPU host (no GPU needed).",
        "",
        f"One sim worker ({state['num_blocks']} KV blocks of {state['block_size']} tokens = "
        f"{state['kv_capacity_tokens']} tokens, max_model_len {state['max_model_len']}). Open-loop Poisson "
        f"arrivals for {args.duration_s} simulated seconds per rate; each request a streamed chat with "
        f"~{args.prompt_words + 10} prompt tokens (random words, no shared prefix) and exactly {args.max_tokens} "
        "output tokens. TTFT is measured by the client (first content chunk) and converted to simulated "
        "seconds. `steady tok/s` = output tokens generated per simulated second while requests were arriving; "
        "`done req/s` and `run tok/s` divide by the whole run, the tail that drains the queue included.",
        "`lag` = simulated time lost because the host could not keep up, as a fraction of busy time; "
        "rows with a large lag show the host's limits, not the model's.",
        "",
        "| offered req/s | done req/s | steady tok/s | run tok/s | TTFT p50 s | TTFT p90 s | e2e p50 s | peak KV | peak running "
        "| peak waiting | preemptions | lag |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['offered']:g} | {r['done_rps']:.2f} | {fmt(r['window_tps'], 0)} | {r['out_tps']:.0f} | {fmt(r['ttft_p50'])} | "
                     f"{fmt(r['ttft_p90'])} | {fmt(r['e2e_p50'], 2)} | {r['peak_kv']:.2f} | {r['peak_running']} | "
                     f"{r['peak_waiting']} | {r['preemptions']} | {r['lag_frac']:.2f} |")
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> str:
    proc, url = await start_worker(args)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            rows = []
            for rate in [float(x) for x in args.rates.split(",")]:
                rows.append(await run_rate(url, rate, args, session))
                row = rows[-1]
                print(f"rate {rate:g}: ok {row['ok']}/{row['requests']} ttft_p50 {fmt(row['ttft_p50'])} s "
                      f"steady {fmt(row['window_tps'], 0)} tok/s peak_kv {row['peak_kv']:.2f} lag {row['lag_frac']:.2f}",
                      flush=True)
                await wait_idle(url, session)
            state = await get_json(session, f"{url}/sim/state")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return markdown(rows, args, state)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim_curve", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="h100-qwen3-vl-8b")
    p.add_argument("--rates", default="2,4,8,12,16,20,24", help="offered loads, simulated requests/s")
    p.add_argument("--duration-s", type=float, default=20.0, help="simulated seconds of arrivals per rate")
    p.add_argument("--prompt-words", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--time-scale", type=float, default=1.0, help="below 1 gives a slow host more headroom")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the markdown table here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    table = asyncio.run(main_async(args))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
