"""Scale benchmark: routing decision time vs fleet size, prefix-index memory bound, proxy memory per stream.

Owns the three scale measurements. Decision time and the prefix index call proxy/routing's own
objects in-process; memory per stream runs a real proxy in front of slow sim workers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.report import environment_note, fmt, md_table, results_path, write_json

POLICIES = ("kv_cost", "kv_aware", "prefix", "least_requests", "power_of_two", "round_robin")
FLEET_SIZES = (10, 100, 1000)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _requests(rng: random.Random, n: int) -> list[Any]:
    """Parsed chat requests: 8 shared system prompts of 200..2000 words plus a unique question."""
    from proxy.request import parse_request

    systems = [" ".join(f"w{rng.randrange(5000)}" for _ in range(200 * (k + 1))) for k in range(8)]
    out = []
    for i in range(n):
        body = {"model": "m", "stream": True, "max_tokens": 128,
                "messages": [{"role": "system", "content": systems[rng.randrange(8)]},
                             {"role": "user", "content": f"question {i}: " + " ".join(
                                 f"q{rng.randrange(9999)}" for _ in range(rng.randint(10, 80)))}]}
        out.append(parse_request(orjson.dumps(body), "chat"))
    return out


def decision_time(sizes: tuple[int, ...], decisions: int, seed: int = 0) -> list[dict[str, Any]]:
    """Microseconds per select_from()+on_dispatch() for each policy and fleet size (engine readings random).

    select_from() over a roster of the fleet, as admission calls it (bench/decision.py times the whole pick).
    """
    from proxy.routing.base import PolicyDeps, make_policy
    from proxy.routing.candidates import Candidates, Roster
    from proxy.workers.loadview import EngineReading
    from proxy.workers.registry import Worker

    rng = random.Random(seed)
    requests = _requests(rng, 512)
    rows = []
    for n in sizes:
        workers = [Worker(f"w{i}", f"http://10.0.{i // 250}.{i % 250}:8000", ["m"], capacity_tokens=300_000)
                   for i in range(n)]
        for w in workers:
            w.load.record_reading(EngineReading(rng.random() * 0.8, rng.randrange(64), rng.randrange(8)),
                                  time.monotonic(), "report")
        roster = Roster(workers)
        candidates = Candidates(roster, frozenset(), workers, len(workers))
        for name in POLICIES:
            policy = make_policy(name, PolicyDeps(rng=random.Random(seed)))
            # warm the prefix index as a running proxy would have it
            for req in requests:
                d = policy.select_from(candidates, req, time.monotonic())
                policy.on_dispatch(d, req, time.monotonic())
            times = []
            for i in range(decisions):
                req = requests[i % len(requests)]
                now = time.monotonic()
                t0 = time.perf_counter_ns()
                d = policy.select_from(candidates, req, now)
                policy.on_dispatch(d, req, now)
                times.append((time.perf_counter_ns() - t0) / 1000.0)
            times.sort()
            rows.append({"workers": n, "policy": name, "p50_us": times[len(times) // 2],
                         "p99_us": times[int(len(times) * 0.99)], "decisions": decisions})
            print(f"[scale] {n} workers {name}: p50 {rows[-1]['p50_us']:.1f} us, p99 {rows[-1]['p99_us']:.1f} us",
                  flush=True)
    return rows


def parse_time(samples: int = 2000, seed: int = 0) -> float:
    """Microseconds to parse one chat body into routing features (done once per request)."""
    from proxy.request import parse_request

    rng = random.Random(seed)
    bodies = [r.body for r in _requests(rng, 64)]
    t0 = time.perf_counter()
    for i in range(samples):
        parse_request(bodies[i % len(bodies)], "chat")
    return (time.perf_counter() - t0) / samples * 1e6


def prefix_index_memory(total: int, checkpoints: int = 5, seed: int = 0) -> list[dict[str, Any]]:
    """Insert `total` synthetic requests (shared heads + unique tails) into the default PrefixIndex;
    RSS growth and entry count at checkpoints show whether it stays bounded."""
    from proxy.routing.prefix_index import PrefixIndex

    rng = random.Random(seed)
    heads = [[rng.getrandbits(63) for _ in range(rng.randint(4, 64))] for _ in range(200)]
    index = PrefixIndex()
    gc.collect()
    base = _rss_bytes()
    rows = []
    step = total // checkpoints
    t0 = time.perf_counter()
    for i in range(1, total + 1):
        chain = heads[rng.randrange(len(heads))] + [rng.getrandbits(63) for _ in range(rng.randint(1, 16))]
        index.insert(chain, f"w{rng.randrange(16)}", float(i))
        if i % step == 0:
            gc.collect()
            rows.append({"requests": i, "blocks": len(index), "max_blocks": index.max_blocks,
                         "rss_growth_mb": (_rss_bytes() - base) / 2**20, "elapsed_s": time.perf_counter() - t0})
            print(f"[scale] prefix index after {i} requests: {len(index)} blocks, "
                  f"+{rows[-1]['rss_growth_mb']:.1f} MB", flush=True)
    return rows


async def _hold_streams(url: str, n: int, opened: set[int], all_open: asyncio.Event) -> None:
    """Open n streams and keep reading them slowly until cancelled; set all_open once each has a chunk."""
    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "m", "stream": True, "max_tokens": 4000, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"stream {i} keep talking"}]}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            async for _ in resp.content.iter_any():
                opened.add(i)
                if len(opened) >= n:
                    all_open.set()
                await asyncio.sleep(0.5)  # read slowly: the point is to keep the stream open

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)), return_exceptions=True)


def memory_per_stream(levels: tuple[int, ...], workers: int = 4) -> list[dict[str, Any]]:
    """RSS of a real kvroute proxy with N streams open against slow sim workers."""
    from bench.fleet import Fleet, SimWorkerSpec, start_kvroute

    log_dir = Path(__file__).resolve().parent / ".runs" / f"scale-{int(time.time())}"
    # time scale 0.02: one decode step takes ~0.5 s of wall time, so streams stay open
    spec = SimWorkerSpec(model="m", preset="h100-qwen3-vl-8b", time_scale=0.02,
                         extra=["--max-num-seqs", str(max(levels)), "--max-num-batched-tokens", "65536"])
    rows = []
    with Fleet(log_dir, [spec] * workers) as fleet:
        router = start_kvroute(fleet, "least_requests")
        try:
            base = router.tree.rss_bytes()
            rows.append({"streams": 0, "rss_mb": base / 2**20, "per_stream_kb": None})
            for n in levels:
                opened: set[int] = set()

                async def drive(n: int = n, opened: set[int] = opened) -> int:
                    all_open = asyncio.Event()
                    task = asyncio.create_task(_hold_streams(router.url, n, opened, all_open))
                    try:
                        await asyncio.wait_for(all_open.wait(), 120)
                    except TimeoutError:
                        pass  # report how many did open
                    await asyncio.sleep(1.0)
                    rss = router.tree.rss_bytes()
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    return rss

                rss = asyncio.run(drive())
                rows.append({"streams": n, "opened": len(opened), "rss_mb": rss / 2**20,
                             "per_stream_kb": (rss - base) / max(1, len(opened)) / 1024})
                print(f"[scale] {len(opened)}/{n} open streams: proxy RSS {rss / 2**20:.1f} MB", flush=True)
                time.sleep(2.0)  # let cancellations reach the workers before the next level
        finally:
            router.stop()
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decisions", type=int, default=2000, help="timed decisions per policy and fleet size")
    p.add_argument("--prefix-requests", type=int, default=1_000_000)
    p.add_argument("--streams", default="250,500,1000", help="open-stream levels for memory per stream")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--name", default="scale")


def run(args: argparse.Namespace) -> int:
    t_start = time.time()
    decisions = decision_time(FLEET_SIZES, args.decisions)
    parse_us = parse_time()
    prefix = prefix_index_memory(args.prefix_requests)
    streams = memory_per_stream(tuple(int(x) for x in args.streams.split(",") if x)) if args.streams else []
    out = [f"# Scale\n\n{environment_note()}; run took {time.time() - t_start:.0f} s.\n",
           "## Routing decision time (in-process, select_from + on_dispatch, prefix index warm)\n",
           f"Parsing a chat body into routing features (once per request): {parse_us:.0f} us.\n"]
    table = []
    for name in POLICIES:
        cells = {r["workers"]: r for r in decisions if r["policy"] == name}
        table.append([name] + [f"{fmt(cells[n]['p50_us'])} / {fmt(cells[n]['p99_us'])}" for n in FLEET_SIZES])
    out.append(md_table(["policy"] + [f"{n} workers: p50 / p99 us" for n in FLEET_SIZES], table))
    out.append(f"\n## Prefix index memory ({args.prefix_requests} synthetic requests, default PrefixIndex)\n")
    out.append(md_table(["requests", "blocks held", "max blocks", "RSS growth MB"],
                        [[r["requests"], r["blocks"], r["max_blocks"], fmt(r["rss_growth_mb"])] for r in prefix]))
    if streams:
        out.append("\n## Proxy memory per in-flight stream (real proxy, slow sim workers)\n")
        out.append(md_table(["open streams", "proxy RSS MB", "KB per stream"],
                            [[r.get("opened", r["streams"]), fmt(r["rss_mb"]), fmt(r["per_stream_kb"])]
                             for r in streams]))
    text = "\n".join(out) + "\n"
    results_path(args.name, ".md", args.out_dir).write_text(text)
    write_json(results_path(args.name, ".json", args.out_dir),
               {"decisions": decisions, "parse_us": parse_us, "prefix": prefix, "streams": streams})
    print(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
