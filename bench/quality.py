"""Routing-quality benchmark: kvroute policies vs peers on sim H100 workers, at 50/80/95% of capacity.

Owns the quality matrix (workload x offered load x route), capacity calibration, the KV-usage
sampler and the quality tables/plots. Processes come from fleet.py, load from loadgen.py.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.fleet import Fleet, SimWorkerSpec, start_router
from bench.loadgen import LoadGenerator, summarize
from bench.report import environment_note, fmt, md_table, ms, plot_cdfs, plot_spread, results_path, write_json
from bench.workloads import KINDS, MODEL_A, MODEL_B, Workload, load_or_generate

ROUTES = (("kvroute", "kv_aware"), ("kvroute", "prefix"), ("kvroute", "least_requests"), ("kvroute", "round_robin"),
          ("vllm-router", "cache_aware"), ("vllm-router", "power_of_two"),
          ("sglang-router", "cache_aware"), ("sglang-router", "power_of_two"),
          ("lmdeploy", "min_expected_latency"))
LOADS = (0.5, 0.8, 0.95)
TTFT_SLO_S = 1.0  # goodput: requests answered with TTFT <= 1 s (simulated seconds)
PRESET = "h200-qwen3-vl-32b"
# KV per worker is capped far below the H200's ~250k tokens so KV pressure appears at request and
# token rates that 2 shared CPU cores can drive through Python and Rust routers without the routers
# themselves running out of CPU (documented in bench/README.md).
KV_CAPACITY_TOKENS = 24_000
WORKERS = 4


def fleet_workers(kind: str, workers: int, time_scale: float, preset: str = PRESET,
                  kv_tokens: int = KV_CAPACITY_TOKENS) -> list[SimWorkerSpec]:
    extra = ["--kv-capacity-tokens", str(kv_tokens)]
    models = [MODEL_A] * workers
    if kind == "mix":  # a quarter of the fleet serves the second model
        models = [MODEL_A] * (workers - max(1, workers // 4)) + [MODEL_B] * max(1, workers // 4)
    return [SimWorkerSpec(model=m, preset=preset, time_scale=time_scale, extra=extra) for m in models]


def direct_targets(fleet: Fleet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec, url in zip(fleet.workers, fleet.urls, strict=True):
        out.setdefault(spec.model, []).append(url)
    return out


class KvSampler:
    """Polls each worker's /metrics every `interval` s: KV usage, running, waiting."""

    def __init__(self, urls: list[str], interval: float = 0.5) -> None:
        self.urls = urls
        self.interval = interval
        self.samples: list[tuple[float, list[float]]] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        t0 = time.perf_counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while not self._stop.is_set():
                usage = []
                for u in self.urls:
                    try:
                        async with s.get(u + "/metrics") as r:
                            text = await r.text()
                        usage.append(_metric(text, "vllm:kv_cache_usage_perc"))
                    except (aiohttp.ClientError, TimeoutError):
                        usage.append(float("nan"))
                self.samples.append((time.perf_counter() - t0, usage))
                try:
                    await asyncio.wait_for(self._stop.wait(), self.interval)
                except TimeoutError:
                    pass

    def stop(self) -> None:
        self._stop.set()

    def spread(self) -> tuple[float | None, float | None]:
        """(time-mean of max-min KV usage across workers, peak usage of any worker)."""
        gaps = [max(u) - min(u) for _, u in self.samples if u and all(x == x for x in u)]
        peak = max((max(u) for _, u in self.samples if u), default=None)
        return (sum(gaps) / len(gaps) if gaps else None), peak


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(fleet: Fleet, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ms_ = fleet.metrics()
        if all(m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0 for m in ms_):
            return
        time.sleep(0.2)
    raise TimeoutError("workers did not drain between cells")


def calibrate(fleet: Fleet, w: Workload, requests: int, concurrency: int, time_limit_s: float) -> float:
    """Fleet capacity in requests per wall second for this workload: a closed loop through client-side
    round robin, with enough clients to fill every worker's KV cache."""
    specs = w.specs(1.0, salt=f"calibrate-{time.time()}", limit=requests)
    run = asyncio.run(LoadGenerator(direct_targets(fleet)).closed_loop(specs, concurrency, time_limit_s))
    wait_idle(fleet)
    # steady state only: the rate between the 20th and 80th percentile of completion times, so the
    # ramp-up and the tail of a short closed loop do not drag the estimate down
    done = sorted(r.sent_at + r.latency_s for r in run.results if r.ok)
    if len(done) < 10:
        raise RuntimeError(f"calibration failed: only {len(done)} requests succeeded")
    lo, hi = int(len(done) * 0.2), int(len(done) * 0.8)
    return (hi - lo) / max(1e-6, done[hi] - done[lo])


async def _open_loop_with_sampler(target: Any, specs: list, sampler: KvSampler):
    task = asyncio.create_task(sampler.run())
    try:
        return await LoadGenerator(target).open_loop(specs)
    finally:
        sampler.stop()
        await task


def run_cell(fleet: Fleet, w: Workload, kind: str, policy: str, rate: float, n: int, time_scale: float,
             salt: str) -> dict[str, Any]:
    t0 = time.monotonic()
    wait_idle(fleet)
    t_idle = time.monotonic()
    router = None if kind == "direct" else start_router(kind, policy, fleet)
    t_router = time.monotonic()
    try:
        target: Any = direct_targets(fleet) if router is None else router.url
        specs = w.specs(rate, salt=salt, limit=n)
        t_specs = time.monotonic()
        before = fleet.metrics()
        cpu0 = router.tree.cpu_seconds() if router else 0.0
        sampler = KvSampler(fleet.urls)
        run = asyncio.run(_open_loop_with_sampler(target, specs, sampler))
        router_cpu = (router.tree.cpu_seconds() - cpu0) / run.wall_s if router else None
        after = fleet.metrics()
    finally:
        if router:
            router.stop()
    # client times are wall seconds; the sim runs time_scale simulated seconds per wall second
    for r in run.results:
        r.latency_s *= time_scale
        r.ttft_s = None if r.ttft_s is None else r.ttft_s * time_scale
    run.wall_s *= time_scale
    row = summarize(run, ttft_slo_s=TTFT_SLO_S)

    def delta(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after, strict=True))

    queries = delta("vllm:prefix_cache_queries_total")
    spread, peak = sampler.spread()
    row.update(route="direct" if router is None else f"{kind}:{policy}", preemptions=int(delta("vllm:num_preemptions_total")),
               prefix_hit=delta("vllm:prefix_cache_hits_total") / queries if queries else None,
               kv_spread=spread, kv_peak=peak, kv_series=sampler.samples, router_cpu=router_cpu,
               chunks_per_wall_s=sum(r.completion_tokens for r in run.results) / (run.wall_s / time_scale),
               ttfts=[r.ttft_s for r in run.results if r.ok and r.ttft_s is not None],
               phases_s={"idle": t_idle - t0, "router_start": t_router - t_idle, "specs": t_specs - t_router,
                         "run": run.wall_s / time_scale})
    return row


def render(sections: list[dict[str, Any]], header: str) -> str:
    out = [header]
    for sec in sections:
        out.append(f"## {sec['kind']} (capacity {sec['capacity']:.2f} req/s, {sec['n']} requests per cell)\n")
        table = []
        for r in sec["rows"]:
            rejected = f"{r['rejected']} ({r['rejected_429']}/{r['rejected_503']})" if r["rejected"] else "0"
            table.append([f"{int(r['load'] * 100)}%", r["route"], r["ok"], rejected, r["failed"],
                          ms(r["ttft_p50"], digits=0), ms(r["ttft_p99"], digits=0), ms(r["lat_p99"], digits=0),
                          fmt(r["req_per_s"], digits=2), fmt(r["output_tok_per_s"], digits=0),
                          fmt(100 * r["goodput_frac"], "%", 0), r["preemptions"],
                          fmt(None if r["prefix_hit"] is None else 100 * r["prefix_hit"], "%", 0),
                          fmt(r["kv_spread"], digits=2), fmt(r["kv_peak"], digits=2),
                          fmt(None if r["router_cpu"] is None else 100 * r["router_cpu"], "%", 0)])
        out.append(md_table(["load", "route", "ok", "rejected (429/503)", "failed", "TTFT p50 ms", "TTFT p99 ms",
                             "e2e p99 ms", "req/s", "out tok/s", "goodput", "preempt", "prefix hit",
                             "KV spread", "KV peak", "router CPU"], table))
        out.append("")
        for failure in sec.get("failed_cells", []):
            out.append(f"- cell not run: {failure}")
        for png in sec.get("plots", []):
            out.append(f"![{png}]({png})")
        out.append("")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default=",".join(KINDS))
    p.add_argument("--loads", default=",".join(str(x) for x in LOADS), help="fractions of calibrated capacity")
    p.add_argument("--routes", default=",".join(f"{k}:{v}" for k, v in ROUTES),
                   help="comma-separated kind:policy (kind kvroute, direct or a peer name)")
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--duration", type=float, default=6.0, help="simulated seconds of arrivals per cell")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim time scale (results are in simulated time)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--preset", default=PRESET, help="sim preset of every worker")
    p.add_argument("--kv-tokens", type=int, default=KV_CAPACITY_TOKENS, help="KV capacity per worker (tokens)")
    p.add_argument("--calibrate-requests", type=int, default=600)
    p.add_argument("--calibrate-seconds", type=float, default=10.0, help="wall-time cap of the calibration")
    p.add_argument("--calibrate-concurrency", type=int, default=64, help="closed-loop clients per worker")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--name", default="quality")


def run(args: argparse.Namespace) -> int:
    routes = [tuple(r.split(":", 1)) if ":" in r else (r, "") for r in args.routes.split(",") if r]
    loads = [float(x) for x in args.loads.split(",")]
    log_dir = Path(__file__).resolve().parent / ".runs" / f"quality-{int(time.time())}"
    sections: list[dict[str, Any]] = []
    t_start = time.time()
    for kind in args.workloads.split(","):
        sections.append(run_workload(args, kind, routes, loads, log_dir))
        write_results(args, sections, t_start)  # after each workload: a cut-short run keeps what it has
    print(write_results(args, sections, t_start))
    return 0 if not any(s["failed_cells"] for s in sections) else 1


def run_workload(args: argparse.Namespace, kind: str, routes: list[tuple[str, str]], loads: list[float],
                 log_dir: Path) -> dict[str, Any]:
    """Calibrate one workload's fleet, then run every (load, route) cell on it; plots included."""
    w = load_or_generate(kind, args.seed, 2000)
    rows: list[dict[str, Any]] = []
    failed_cells: list[str] = []
    with Fleet(log_dir / kind, fleet_workers(kind, args.workers, args.time_scale, args.preset,
                                             args.kv_tokens)) as fleet:
        capacity_wall = calibrate(fleet, w, args.calibrate_requests, args.calibrate_concurrency * args.workers,
                                  args.calibrate_seconds)
        capacity = capacity_wall / args.time_scale  # requests per simulated second
        n = min(len(w.requests), max(30, int(capacity * max(loads) * args.duration)))
        print(f"[quality] {kind}: capacity {capacity:.2f} req/s (simulated); {n} requests per cell", flush=True)
        for load in loads:
            for kind_r, policy in routes:
                salt = f"{kind}-{load}-{kind_r}-{policy}-{time.time()}"
                try:
                    row = run_cell(fleet, w, kind_r, policy, capacity_wall * load, n, args.time_scale, salt)
                except Exception as exc:  # one broken router must not cost the other cells
                    print(f"[quality]   {int(load * 100)}% {kind_r}:{policy} FAILED: {exc}", flush=True)
                    failed_cells.append(f"{int(load * 100)}% {kind_r}:{policy}: {str(exc)[:300]}")
                    continue
                row["load"] = load
                rows.append(row)
                print(f"[quality]   {int(load * 100)}% {row['route']}: ok={row['ok']} rej={row['rejected']} "
                      f"fail={row['failed']} ttft p99={ms(row['ttft_p99'], digits=0)}ms "
                      f"goodput={100 * row['goodput_frac']:.0f}% preempt={row['preemptions']} "
                      f"kv peak={fmt(row['kv_peak'], digits=2)} hit={fmt(row['prefix_hit'], digits=2)} "
                      f"router cpu={fmt(row['router_cpu'], digits=2)} chunks/s={row['chunks_per_wall_s']:.0f} "
                      f"phases={ {k: round(v, 1) for k, v in row['phases_s'].items()} }", flush=True)
    plots = []
    for load in loads:
        png = results_path(f"{args.name}-{kind}-{int(load * 100)}-ttft-cdf", ".png", args.out_dir)
        if plot_cdfs(png, {r["route"]: r["ttfts"] for r in rows if r["load"] == load},
                     f"{kind} at {int(load * 100)}% load: TTFT CDF (simulated ms)", "TTFT (ms), successful requests"):
            plots.append(png.name)
    png = results_path(f"{args.name}-{kind}-kv-spread", ".png", args.out_dir)
    top = max(loads)
    if plot_spread(png, {r["route"]: ([t * args.time_scale for t, _ in r["kv_series"]],
                                      [max(u) - min(u) for _, u in r["kv_series"]])
                         for r in rows if r["load"] == top},
                   f"{kind} at {int(top * 100)}% load: KV usage spread (max - min across workers)", "KV usage spread"):
        plots.append(png.name)
    return {"kind": kind, "capacity": capacity, "n": n, "rows": rows, "plots": plots, "failed_cells": failed_cells}


def write_results(args: argparse.Namespace, sections: list[dict[str, Any]], t_start: float) -> str:
    header = (f"# Routing quality\n\n{environment_note()}; run took {time.time() - t_start:.0f} s.\n\n"
              f"Fleet: {args.workers} sim workers, preset {args.preset}, KV capped at {args.kv_tokens} tokens "
              f"per worker, time scale {args.time_scale} (all times below are simulated). Offered load = "
              f"fraction of the capacity measured by a closed-loop calibration through client-side round "
              f"robin ({args.calibrate_concurrency} clients per worker). Each cell: {args.duration:g} s of "
              f"arrivals. Goodput = share of all requests (rejected ones included) with TTFT <= "
              f"{TTFT_SLO_S:.0f} s. KV spread = time-mean of (max - min) KV usage across workers, sampled "
              f"every 0.5 s. Router CPU = share of one core. Workload seed {args.seed}.\n")
    text = render(sections, header)
    results_path(args.name, ".md", args.out_dir).write_text(text)
    write_json(results_path(args.name, ".json", args.out_dir),
               [{**{k: v for k, v in r.items() if k not in ("ttfts", "kv_series")}, "kind": s["kind"]}
                for s in sections for r in s["rows"]])
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
