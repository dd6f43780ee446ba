"""Overhead benchmark: what a router costs over calling 4 fast sim workers directly (issue 6 and 3).

Owns the overhead workloads, the list of routes and the overhead table; processes come from
fleet.py/peers.py, load from loadgen.py. Routes run one after another on the same workers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet import BARE_RELAY, Fleet, SimWorkerSpec, start_router
from bench.loadgen import LoadGenerator, RequestSpec, chat_body, summarize
from bench.report import cdf, environment_note, fmt, md_table, ms, results_path, write_json

KVROUTE_POLICIES = ("kv_cost", "kv_aware", "prefix", "least_requests", "round_robin")
# kvroute with client API keys on (KVROUTE_API_KEYS); every route, peers and direct included, is sent the
# same Authorization header, so the only difference is the proxy checking it.
KEYS_PATH = "kvroute-keys"
BENCH_API_KEY = "bench-overhead-key"
PEER_ROUTES = (("vllm-router", "round_robin"), ("vllm-router", "cache_aware"),
               ("sglang-router", "round_robin"), ("sglang-router", "cache_aware"),
               ("lmdeploy", "min_expected_latency"))
# h100-qwen3-vl-8b at time scale 1.15 decodes a token in ~10 ms at low batch, as in peers.md's runs
SIM_PRESET, SIM_TIME_SCALE = "h100-qwen3-vl-8b", 1.15
TINY_MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen3-vl"


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    concurrency: int
    max_tokens: int
    stream: bool
    words: int = 40  # per prompt: 40 is ~240 tokens of the tiny model's tokenizer, 1700 ~10.3k


def workloads(scale: float = 1.0) -> list[Workload]:
    def n(x: int) -> int:
        return max(20, int(x * scale))

    return [Workload("stream", n(2000), 64, 16, True), Workload("stress", n(6000), 256, 4, True),
            Workload("nonstream", n(2000), 64, 16, False),
            # 10k-token prompts, each new: the most a proxy counting exact tokens does per request
            Workload("long", n(300), 16, 16, True, words=1700)]


def _distinct_prompt(rng: random.Random, words: int = 40) -> str:
    # distinct from the first word on, so prefix-matching routers see no shared prefix to chase
    return " ".join(rng.choice(_VOCAB) + str(rng.randrange(1000)) for _ in range(words))


_VOCAB = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
          "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def make_specs(w: Workload, model: str, seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(chat_body(model, [{"role": "user", "content": _distinct_prompt(rng, w.words)}], w.max_tokens,
                                  w.stream)) for _ in range(w.requests)]


def _spread(before: list[dict[str, float]], after: list[dict[str, float]]) -> float | None:
    """(max - min) / mean of requests served per worker during the cell, from the workers' counters."""
    counts = [a.get("vllm:request_success_total", 0.0) - b.get("vllm:request_success_total", 0.0)
              for b, a in zip(before, after, strict=True)]
    mean = sum(counts) / len(counts) if counts else 0.0
    return (max(counts) - min(counts)) / mean if mean else None


async def _measure(targets: str | list[str], specs: list[RequestSpec], concurrency: int):
    headers = {"Authorization": f"Bearer {BENCH_API_KEY}"}
    return await LoadGenerator(targets, headers=headers).closed_loop(specs, concurrency)


def run_cell(fleet: Fleet, kind: str, policy: str, w: Workload, model: str, warmup: int) -> dict[str, Any]:
    """One route x one workload: start the router, warm up, measure, stop it."""
    router = None if kind == "direct" else _start(kind, policy, fleet)
    try:
        targets: str | list[str] = fleet.urls if router is None else router.url
        warm = Workload(w.name, warmup, w.concurrency, w.max_tokens, w.stream, w.words)
        # fresh prompts for every cell (and its warm-up): the sim caches prefixes, and a cell that
        # replayed an earlier cell's prompts ran ~30 ms faster to first token (measured)
        cell_seed = random.Random(f"{kind}:{policy}:{w.name}:{time.time()}").getrandbits(48)
        asyncio.run(_measure(targets, make_specs(warm, model, seed=cell_seed + 1), w.concurrency))
        before = fleet.metrics()
        cpu0 = router.tree.cpu_seconds() if router else 0.0
        run = asyncio.run(_measure(targets, make_specs(w, model, seed=cell_seed), w.concurrency))
        cpu1 = router.tree.cpu_seconds() if router else 0.0
        after = fleet.metrics()
        row = summarize(run)
        cpu_s = cpu1 - cpu0
        # every streamed answer is its content chunks plus the role chunk and [DONE]
        chunks = sum(r.completion_tokens + 2 for r in run.results if r.ok) if w.stream else 0
        row.update(route=f"{kind}:{policy}" if router else ("direct" if not policy else "direct (again)"),
                   workload=w.name,
                   cpu_us_per_req=(cpu1 - cpu0) / max(1, row["ok"]) * 1e6 if router else None,
                   rss_mb=router.tree.rss_bytes() / 2**20 if router else None,
                   chunks_per_cpu_s=chunks / cpu_s if router and chunks and cpu_s > 0 else None,
                   spread=_spread(before, after),
                   latencies=[r.latency_s for r in run.results if r.ok],
                   ttfts=[r.ttft_s for r in run.results if r.ok and r.ttft_s is not None])
        return row
    finally:
        if router:
            router.stop()


def _start(kind: str, policy: str, fleet: Fleet):
    variants = {KEYS_PATH: ("KVROUTE_API_KEYS", BENCH_API_KEY)}
    if kind not in variants:
        return start_router(kind, policy, fleet)
    name, value = variants[kind]
    saved = os.environ.get(name)
    os.environ[name] = value  # inherited by the proxy process start_router spawns
    try:
        return start_router("kvroute", policy, fleet)
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


BASELINE_KEYS = ("lat_p50", "lat_p99", "ttft_p50", "ttft_p99")


def direct_baseline(cell: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean of the direct runs (first and last cell of a workload, so drift during the run cancels)."""
    direct = [r for r in cell if r["route"].startswith("direct")]
    if not direct:
        return None
    return {k: sum(r[k] for r in direct) / len(direct) for k in BASELINE_KEYS if all(r[k] is not None for r in direct)}


REFERENCE_ROUTE = "vllm-router:round_robin"  # issue 10's yardstick


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _span(values: list[float | None], scale: float = 1.0, digits: int = 0, signed: bool = False) -> str:
    """`median (min..max)` of the repeats; one value alone; `-` for none."""
    got = [v * scale for v in values if v is not None]
    if not got:
        return "-"
    text = fmt(_median(got), digits=digits, signed=signed)
    return text if len(got) == 1 else f"{text} ({fmt(min(got), digits=digits, signed=signed)}.."\
        f"{fmt(max(got), digits=digits, signed=signed)})"


def render_repeats(rows: list[dict[str, Any]]) -> str:
    """Per workload and route over the repeats: median (min..max); added latency against the direct runs of the
    same repeat; CPU as a ratio to vllm-router round_robin's in the same repeat."""
    out = ["## Over the repeats: median (min..max)\n"]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        cell = [r for r in rows if r["workload"] == wl]
        repeats = sorted({r.get("repeat", 0) for r in cell})
        base = {k: direct_baseline([r for r in cell if r.get("repeat", 0) == k]) for k in repeats}
        ref = {r.get("repeat", 0): r["cpu_us_per_req"] for r in cell if r["route"] == REFERENCE_ROUTE}

        def added(r: dict[str, Any], key: str, base: dict = base) -> float | None:
            b = base.get(r.get("repeat", 0))
            return None if not b or r[key] is None or key not in b else r[key] - b[key]

        table = []
        for route in dict.fromkeys(r["route"] for r in cell):
            if route.startswith("direct"):
                continue
            rs = [r for r in cell if r["route"] == route]
            ratio = [r["cpu_us_per_req"] / ref[r.get("repeat", 0)] for r in rs
                     if r["cpu_us_per_req"] and ref.get(r.get("repeat", 0))]
            table.append([route, len(rs), sum(r["failed"] for r in rs), _span([r["req_per_s"] for r in rs]),
                          _span([added(r, "lat_p50") for r in rs], 1000, 1, True),
                          _span([added(r, "lat_p99") for r in rs], 1000, 1, True),
                          _span([r["cpu_us_per_req"] for r in rs]), _span(ratio, digits=2),
                          _span([r.get("chunks_per_cpu_s") for r in rs])])
        out.append(f"### {wl}\n")
        out.append(md_table(["route", "repeats", "failed", "req/s", "added p50 ms", "added p99 ms", "CPU us/req",
                             f"CPU / {REFERENCE_ROUTE}", "chunks/s per core"], table))
        out.append("")
    return "\n".join(out)


def render(rows: list[dict[str, Any]], sizes: str) -> str:
    out = [f"# Router overhead over direct calls\n\n{environment_note()}\n\n{sizes}\n",
           "Added latency/TTFT = router's percentile minus direct's (client-side round robin; mean of a direct "
           "run before and after the routers) in the same run. "
           "CPU = router process tree utime+stime (/proc, children included) per successful request. "
           "Spread = (max - min) / mean of requests served per worker (workers' vllm:request_success_total). "
           "Chunks/s per core = SSE chunks relayed (content chunks + role chunk + [DONE]) per second of the "
           "router's CPU: what one saturated core carries.\n"]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        cell = [r for r in rows if r["workload"] == wl]
        base = direct_baseline(cell)

        def added(r: dict[str, Any], key: str, base: dict[str, float] | None = base) -> str:
            if not base or r[key] is None or key not in base:
                return "-"
            return ms(r[key] - base[key], signed=True)

        table = [[r["route"], r["ok"], r["failed"], r["rejected"], fmt(r["req_per_s"], digits=0),
                  added(r, "lat_p50"), added(r, "lat_p99"), added(r, "ttft_p50"), added(r, "ttft_p99"),
                  fmt(r["cpu_us_per_req"], digits=0), fmt(r["rss_mb"], digits=0),
                  fmt(r.get("chunks_per_cpu_s"), digits=0), fmt(r["spread"], digits=2)]
                 for r in cell]
        out.append(f"## {wl}\n")
        out.append(md_table(["route", "ok", "failed", "rejected", "req/s", "added p50 ms", "added p99 ms",
                             "added TTFT p50 ms", "added TTFT p99 ms", "CPU us/req", "RSS MB", "chunks/s per core",
                             "spread"], table))
        out.append("")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=float, default=1.0, help="multiply request counts (0.1 for a quick look)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=200, help="unmeasured requests before each cell")
    p.add_argument("--policies", default=",".join(KVROUTE_POLICIES), help="kvroute policies, comma-separated")
    p.add_argument("--no-peers", action="store_true", help="kvroute and direct only")
    p.add_argument("--with-keys", default="",
                   help="kvroute policies to run also with client API keys on, comma-separated")
    p.add_argument("--bare-relay", action="store_true",
                   help="also run bench/bare_relay.py (round robin and nothing else: the floor of a Python relay)")
    p.add_argument("--peers", default=",".join(sorted({p for p, _ in PEER_ROUTES})),
                   help="peer routers to include, comma-separated")
    p.add_argument("--workloads", default="stream,stress,nonstream", help="of stream, stress, nonstream, long")
    p.add_argument("--tokenizer", default=str(TINY_MODEL) if (TINY_MODEL / "tokenizer.json").exists() else "none",
                   help="checkpoint folder the sims count prompts with and hand the proxy, so it counts exact tokens "
                        "as it does for vLLM workers (default: the tiny Qwen3-VL's when built; 'none': the sims' "
                        "own rule and no tokenizer at the proxy)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every route per workload (median and range)")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default bench/results)")
    p.add_argument("--name", default="overhead")


def run(args: argparse.Namespace) -> int:
    routes: list[tuple[str, str]] = [("direct", "")]
    routes += [("kvroute", p) for p in args.policies.split(",") if p]
    routes += [(KEYS_PATH, p) for p in args.with_keys.split(",") if p]
    if args.bare_relay:
        routes.append((BARE_RELAY, "round_robin"))
    if not args.no_peers:
        wanted = set(args.peers.split(","))
        routes += [r for r in PEER_ROUTES if r[0] in wanted]
    routes.append(("direct", "again"))
    chosen = [w for w in workloads(args.scale) if w.name in args.workloads.split(",")]
    log_dir = Path(__file__).resolve().parent / ".runs" / f"overhead-{int(time.time())}"
    model = "m"
    rows: list[dict[str, Any]] = []
    failed_cells: list[str] = []
    tokenizer = [] if args.tokenizer == "none" else ["--tokenizer", args.tokenizer]
    spec = SimWorkerSpec(model=model, preset=SIM_PRESET, time_scale=SIM_TIME_SCALE,
                         extra=["--max-num-seqs", "512", *tokenizer])
    with Fleet(log_dir, [spec] * args.workers) as fleet:
        for w in chosen:
            for repeat in range(args.repeats):
                # routers in turn, the order reversed every other repeat so drift during a run favours none;
                # a direct run opens and closes each repeat
                middle = routes[1:-1] if repeat % 2 == 0 else routes[-2:0:-1]
                for kind, policy in [routes[0], *middle, routes[-1]]:
                    print(f"[overhead] {w.name} #{repeat + 1} {kind}:{policy} ...", flush=True)
                    try:
                        row = run_cell(fleet, kind, policy, w, model, min(args.warmup, max(20, w.requests // 10)))
                    except Exception as exc:  # one broken router must not cost the other cells
                        print(f"[overhead]   FAILED: {exc}", flush=True)
                        failed_cells.append(f"{w.name} #{repeat + 1} {kind}:{policy}: {str(exc)[:300]}")
                        continue
                    row["repeat"] = repeat
                    print(f"[overhead]   ok={row['ok']} failed={row['failed']} req/s={row['req_per_s']:.0f} "
                          f"p99={ms(row['lat_p99'])}ms cpu/req={fmt(row['cpu_us_per_req'], digits=0)}us",
                          flush=True)
                    rows.append(row)
    sizes = ("Fleet: {} sim workers, preset {} at time scale {} (~10 ms per decode step){}. {} repeat(s) per cell. "
             "Workloads: {}.".format(
        args.workers, SIM_PRESET, SIM_TIME_SCALE,
        "" if not tokenizer else f", counting prompts with {Path(args.tokenizer).name}'s tokenizer and handing it "
                                 "to kvroute (exact prompt tokens)",
        args.repeats,
        "; ".join(f"{w.name} = {w.requests} requests at concurrency {w.concurrency}, {w.words}-word prompts, "
                  f"{w.max_tokens} tokens, {'streaming' if w.stream else 'non-streaming'}" for w in chosen)))
    md_path = results_path(args.name, ".md", args.out_dir)
    text = render(rows, sizes) + "\n" + render_repeats(rows) + "".join(f"\n- cell not run: {f}" for f in failed_cells)
    text += "\nLatency CDFs: `kvroute bench plot` on the JSON beside this file.\n"
    md_path.write_text(text)
    # each row keeps its latency distribution as a CDF (bench/report.py), not the samples
    write_json(results_path(args.name, ".json", args.out_dir),
               [{**{k: v for k, v in r.items() if k not in ("latencies", "ttfts")},
                 "latency_cdf": cdf(r["latencies"])} for r in rows])
    print(text)
    print(f"[overhead] wrote {md_path}")
    return 0 if not failed_cells and all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
