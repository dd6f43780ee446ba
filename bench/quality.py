"""Routing-quality benchmark (issue 9): kvroute's default vs its other policies, the peers and an oracle.

Owns the matrix (family x load x route x repeat), capacity calibration, per-cell measurement from the
sims' own state and the result files; the tables come from quality_report.py, processes from fleet.py,
load from loadgen.py, workloads from workloads.py and traces.py, the oracle from oracle.py.

Every cell runs on a FRESH fleet (new sim processes: empty caches, zeroed counters) and a fresh router.
Engine-side figures (prefix-cache hits, preemptions, requests per worker) are deltas of each sim's
GET /sim/state around the cell. Times are simulated seconds (wall x time scale; 1 by default).
The markdown is generated from the JSON (`--render FILE.json` regenerates it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from backends.sim.presets import get_preset
from bench.fleet import Fleet, SimWorkerSpec, default_policy, reads_kv_events, start_router
from bench.loadgen import LoadGenerator, RunResult, summarize
from bench.quality_report import headline, render
from bench.report import cdf, environment_note, fmt, ms, results_path, write_json
from bench.tails import cold_start, save_requests, ttft_p99_after_first_wave
from bench.traces import (
    DEFAULT_DURATION_S,
    TRACE_DIR,
    TRACE_FAMILIES,
    BlockVocabulary,
    TraceWorkload,
    family_for_path,
    load_window,
    trace_path,
)
from bench.workloads import DEFAULT_REQUESTS, FAMILIES, KINDS, MODEL_A, Workload, load_or_generate
from proxy import promtext

ROUTES = ("kvroute:default", "kvroute:kv_aware", "kvroute:round_robin", "oracle",
          "sglang-router:cache_aware", "sglang-router:power_of_two",
          "vllm-router:cache_aware", "vllm-router:power_of_two", "lmdeploy:min_expected_latency")
LOADS = ("closed", "0.5", "0.8", "0.95", "1.1")
PRESET = "h100-qwen3-vl-8b"
WORKERS = 4
REPEATS = 3
TTFT_SLO_S = 1.0
CLOSED_CLIENTS_PER_WORKER = 32
QUICK_DIR = Path(__file__).resolve().parent / ".runs" / "quick-results"
# rough wall seconds per cell besides the load itself (fleet start, router start, drain), for the ETA
CELL_OVERHEAD_S = 12.0


def route_label(route: str) -> str:
    return f"kvroute:default ({default_policy()})" if route == "kvroute:default" else route


def fleet_specs(w: Workload | TraceWorkload, workers: int, time_scale: float, preset: str, kv_tokens: int | None) -> list[SimWorkerSpec]:
    extra = ["--kv-capacity-tokens", str(kv_tokens or w.kv_tokens)]
    return [SimWorkerSpec(model=m, preset=preset, time_scale=time_scale, extra=extra)
            for m in w.worker_models_for(workers)]


def cell_fleet(args: argparse.Namespace, w: Workload | TraceWorkload, route: str, log_dir: Path) -> Fleet:
    """A fresh fleet for one route; its sims publish KV-cache events only for a router that reads them."""
    kind, _, policy = route.partition(":")
    return Fleet(log_dir, fleet_specs(w, args.workers, args.time_scale, args.preset, args.kv_tokens),
                 kv_events=reads_kv_events(kind, policy))


def direct_targets(fleet: Fleet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec, url in zip(fleet.workers, fleet.urls, strict=True):
        out.setdefault(spec.model, []).append(url)
    return out


def engine_deltas(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """Prefix-cache hit rate, prefilled tokens, preemptions and finished requests per worker, from /sim/state."""
    def d(key: str) -> list[float]:
        return [a.get(key, 0) - b.get(key, 0) for b, a in zip(before, after, strict=True)]

    # hit rate: first admissions only (vLLM's counters); prefilled tokens: re-admissions after preemption too
    queries, hits = sum(d("prefix_cache_queries")), sum(d("prefix_cache_hits"))
    recomputed = sum(d("preempted_prefix_cache_queries")) - sum(d("preempted_prefix_cache_hits"))
    return {"prefix_hit": hits / queries if queries else None, "prefill_tokens": int(queries - hits + recomputed),
            "preemptions": int(sum(d("num_preemptions"))), "per_worker": [int(x) for x in d("num_finished")],
            # simulated time the engines fell behind the wall clock (CPU starvation of the sims): should be ~0
            "engine_lag_s": max(d("lag_sim_s"), default=0.0)}


def run_load(target: Any, specs: list, load: str, concurrency: int) -> RunResult:
    gen = LoadGenerator(target)
    if load == "closed":
        return asyncio.run(gen.closed_loop(specs, concurrency))
    return asyncio.run(gen.open_loop(specs))


def run_cell(args: argparse.Namespace, w: Workload | TraceWorkload, route: str, load: str, rate_wall: float, salt: str,
             log_dir: Path) -> dict[str, Any]:
    """One (route, load) run on a fresh fleet; times in simulated seconds."""
    kind, _, policy = route.partition(":")
    with cell_fleet(args, w, route, log_dir) as fleet:
        router = None if kind == "direct" else start_router(kind, policy, fleet)
        try:
            target: Any = direct_targets(fleet) if router is None else router.url
            specs = w.specs(rate_wall if load != "closed" else 1.0, salt=salt, limit=args.requests)
            if args.warm:
                asyncio.run(LoadGenerator(target).closed_loop(w.warm_up_specs(salt, args.requests), 1))
            before = fleet.sim_states()
            cpu0 = router.tree.cpu_seconds() if router else 0.0
            run = run_load(target, specs, load, args.closed_clients * args.workers)
            router_cpu = (router.tree.cpu_seconds() - cpu0) / run.wall_s if router else None
            after = fleet.sim_states()
            oracle_stats = _oracle_stats(router.url) if kind == "oracle" and router else None
            holders_left = _holders_left(router.url) if kind == "kvroute" and router else None
        finally:
            if router:
                router.stop()
    ts = args.time_scale
    warm = ttft_p99_after_first_wave(run) if load == "closed" else None  # wall seconds, scaled below
    for r in run.results:
        r.latency_s *= ts
        r.ttft_s = None if r.ttft_s is None else r.ttft_s * ts
    run.wall_s *= ts
    row = summarize(run, ttft_slo_s=args.ttft_slo)
    row.pop("per_worker", None)  # the client's view; the engines' own count is below
    done = [r.sent_at * ts + r.latency_s for r in run.results if r.ok]
    if warm is not None:
        row["ttft_p99_warm"] = warm * ts
    if not args.warm:
        row.update(cold_start(w, run))
    if args.save_requests:
        save_requests(args.save_requests, w, route, load, salt, run)
    row.update(engine_deltas(before, after), route=route, load=load, router_cpu=router_cpu, oracle=oracle_stats,
               oracle_decision_p50_s=(oracle_stats or {}).get("p50_s"), holders_left=holders_left,
               makespan_s=max(done) if done else None,
               ttfts=[r.ttft_s for r in run.results if r.ok and r.ttft_s is not None])
    return row


def _oracle_stats(url: str) -> dict[str, Any] | None:
    from bench.peers import _get

    status, body = _get(url + "/oracle/stats", 5.0)
    return json.loads(body) if status == 200 else None


def _holders_left(url: str) -> int | None:
    """kvroute's decisions that sent a request away from a worker caching more than half its prompt (kv_aware's
    reason `left_holder` in its routing_decisions counter); None when /metrics does not answer."""
    from bench.peers import _get

    status, body = _get(url + "/metrics", 5.0)
    if status != 200:
        return None
    name = "kvroute:routing_decisions_total"
    return int(promtext.parse(body.decode(errors="replace"), names=[name]).total(name, {"reason": "left_holder"}) or 0)


def calibrate(args: argparse.Namespace, w: Workload | TraceWorkload, log_dir: Path) -> tuple[float, dict[str, float]]:
    """Fleet capacity for this family in requests per wall second: the highest steady-state throughput
    (completions between the 20th and 80th percentile finish times) of a closed loop through each of
    `--calibrate-routes`, so offered loads are fractions of what the best of them sustains, not of what
    a weak router manages. Returns (capacity, per route)."""
    per_route: dict[str, float] = {}
    for route in [r for r in args.calibrate_routes.split(",") if r]:
        try:
            per_route[route] = _calibrate_one(args, w, route, log_dir / route.replace(":", "-"))
        except Exception as exc:  # a route that cannot run is reported with its cells; the others still count
            print(f"[quality] calibration through {route} failed: {exc}", flush=True)
    if not per_route:
        raise RuntimeError("no calibration route succeeded")
    return max(per_route.values()), per_route


def _calibrate_one(args: argparse.Namespace, w: Workload | TraceWorkload, route: str, log_dir: Path) -> float:
    kind, _, policy = route.partition(":")
    with cell_fleet(args, w, route, log_dir) as fleet:
        router = None if kind == "direct" else start_router(kind, policy, fleet)
        try:
            target: Any = direct_targets(fleet) if router is None else router.url
            specs = w.specs(1.0, salt=f"calibrate-{time.time()}", limit=args.calibrate_requests)
            run = asyncio.run(LoadGenerator(target).closed_loop(specs, args.closed_clients * args.workers,
                                                                args.calibrate_seconds))
        finally:
            if router:
                router.stop()
    done = sorted(r.sent_at + r.latency_s for r in run.results if r.ok)
    if len(done) < 10:
        raise RuntimeError(f"calibration failed: only {len(done)} requests succeeded ({run.results[0].error})")
    lo, hi = int(len(done) * 0.2), int(len(done) * 0.8)
    return (hi - lo) / max(1e-6, done[hi] - done[lo])


# ---- command line --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default=None,
                   help=f"comma-separated, from {', '.join(KINDS + tuple(TRACE_FAMILIES))} (default: all, the trace "
                        f"families whose file is in --trace-dir; with --trace: only those traces)")
    p.add_argument("--loads", default=",".join(LOADS), help="'closed' and/or fractions of measured capacity")
    p.add_argument("--routes", default=",".join(ROUTES),
                   help="comma-separated kind:policy; kind kvroute (policy 'default' = ProxyConfig's), oracle (policy ttft, kv_aware or kv_aware_owner), "
                        "direct (client-side round robin) or a peer (sglang-router, vllm-router, lmdeploy)")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per cell (default {DEFAULT_REQUESTS}; a trace family: its whole window)")
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="sim time scale; >1 makes report-driven routing see staler state (interval x scale)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--preset", default=PRESET)
    p.add_argument("--kv-tokens", type=int, default=None, help="override the family's KV cap per worker")
    p.add_argument("--closed-clients", type=int, default=CLOSED_CLIENTS_PER_WORKER, help="closed-loop clients per worker")
    p.add_argument("--ttft-slo", type=float, default=TTFT_SLO_S, help="goodput threshold, simulated seconds")
    p.add_argument("--calibrate-routes", default="oracle,kvroute:default,sglang-router:cache_aware",
                   help="capacity = the best closed-loop throughput among these routes")
    p.add_argument("--calibrate-requests", type=int, default=800)
    p.add_argument("--calibrate-seconds", type=float, default=90.0, help="wall-time cap of the calibration")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default bench/results/, or bench/.runs/quick-results/ for a quick run")
    p.add_argument("--name", default=None,
                   help="result file name after the date; default quality-matrix, plus -FAMILY,... for a subset")
    p.add_argument("--warm", action="store_true",
                   help="before each cell, send every shared prefix once (one token, not measured): steady state, "
                        "without the cold first uses")
    p.add_argument("--trace", type=Path, action="append", default=[], metavar="FILE",
                   help="replay this Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, "
                        "hash_ids of 512-token blocks) as family trace_<name>; repeatable")
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR,
                   help="where the trace_* families' files are (Mooncake's FAST25-release/traces/ names)")
    p.add_argument("--trace-start", type=float, default=0.0, help="trace window: seconds into the trace")
    p.add_argument("--trace-duration", type=float, default=DEFAULT_DURATION_S,
                   help="trace window: its length in the trace's own seconds (0: to the end)")
    p.add_argument("--trace-tokenizer", type=Path, default=None, metavar="PATH",
                   help="render trace blocks with words that are one token in this tokenizer.json (or model dir) "
                        "too, not only in the sim's: prompts exact for a real engine serving that model")
    p.add_argument("--save-requests", type=Path, default=None, metavar="FILE",
                   help="append each request's tag, worker, TTFT and latency (JSON lines) to FILE")
    p.add_argument("--render", type=Path, default=None, help="only regenerate the markdown from this JSON file")
    p.add_argument("--headline", type=Path, default=None,
                   help="only print the headline table and verdicts of this JSON file")


def is_quick(requests: int, repeats: int) -> bool:
    """A run too small to compare routers: written outside bench/results/ and marked not meaningful."""
    return requests < DEFAULT_REQUESTS or repeats < REPEATS


def run(args: argparse.Namespace) -> int:
    if args.headline:
        print(headline(json.loads(args.headline.read_text())))
        return 0
    if args.render:
        data = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(render(data))
        print(args.render.with_suffix(".md"))
        return 0
    families, trace_files = select_families(args)
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    routes = [r for r in args.routes.split(",") if r]
    if args.name is None:
        args.name = "quality-matrix" + ("" if args.families is None and not args.trace else "-" + "+".join(families))
    quick = is_quick(args.requests or DEFAULT_REQUESTS, args.repeats) or \
        bool(trace_files and 0 < args.trace_duration < DEFAULT_DURATION_S)
    out_dir = args.out_dir or (QUICK_DIR if quick else None)
    import shlex
    import sys

    data: dict[str, Any] = {"meta": {
        "quick": quick, "environment": environment_note(), "command": "kvroute bench quality " +
        shlex.join(sys.argv[sys.argv.index("quality") + 1:] if "quality" in sys.argv else sys.argv[1:]),
        "workers": args.workers, "preset": args.preset, "time_scale": args.time_scale,
        "requests": args.requests or DEFAULT_REQUESTS,
        "repeats": args.repeats, "closed_clients": args.closed_clients, "calibrate_routes": args.calibrate_routes,
        "ttft_slo": args.ttft_slo, "default_policy": default_policy(), "warm": args.warm, "families": {}, "took_s": 0.0},
        "rows": [], "failed_cells": []}
    log_dir = Path(__file__).resolve().parent / ".runs" / f"quality-{int(time.time())}"
    t_start = time.time()
    total = len(families) * len(routes) * len(loads) * args.repeats
    done_cells = 0
    vocab = BlockVocabulary(args.trace_tokenizer) if trace_files else None
    for family in families:
        try:
            w = family_workload(args, family, trace_files, vocab)
        except (OSError, ValueError) as exc:  # a trace file missing or malformed: the other families still run
            print(f"[quality] {family}: not run: {exc}", flush=True)
            data["failed_cells"].append(f"{family}: {exc}")
            continue
        fam: dict[str, Any] = {"kv_tokens": args.kv_tokens or w.kv_tokens,
                               "shared_prefix_tokens": w.shared_prefix_tokens(), "ttft_cdf": {}}
        if isinstance(w, TraceWorkload):
            fam.update(w.meta(), note=w.note, loads=loads)
        data["meta"]["families"][family] = fam
        capacity_wall = None
        if any(x != "closed" for x in loads):
            capacity_wall, per_route = calibrate(args, w, log_dir / family / "calibrate")
            fam["capacity"] = capacity_wall / args.time_scale
            fam["capacity_by_route"] = {r: c / args.time_scale for r, c in per_route.items()}
            print(f"[quality] {family}: capacity {fam['capacity']:.2f} req/s (simulated)", flush=True)
        ttfts: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.repeats):  # repeats outermost: drift on the machine spreads over every route
            for load in loads:
                for route in routes:
                    rate = None if load == "closed" else capacity_wall * float(load)
                    salt = f"{family}-{load}-{route}-{rep}-{time.time()}"
                    t0 = time.time()
                    try:
                        row = run_cell(args, w, route, load, rate or 1.0, salt,
                                       log_dir / family / f"{load}-{route.replace(':', '-')}-{rep}")
                    except Exception as exc:  # one broken router must not cost the other cells
                        print(f"[quality]   {family} {load} {route} #{rep} FAILED: {exc}", flush=True)
                        data["failed_cells"].append(f"{family} {load} {route} #{rep}: {str(exc)[:300]}")
                        continue
                    finally:
                        done_cells += 1
                    ttfts.setdefault((load, route), []).extend(row.pop("ttfts"))
                    row.update(family=family, repeat=rep, label=route_label(route))
                    if isinstance(w, TraceWorkload):  # the trace, its window and how much faster it was replayed
                        row.update(w.meta(), trace_speedup=None if rate is None else
                                   rate / args.time_scale / w.native_rate)
                    data["rows"].append(row)
                    eta = (time.time() - t_start) / done_cells * (total - done_cells)
                    extra = "" if not row.get("oracle") else \
                        f" oracle decision p50/p99={ms(row['oracle']['p50_s'], digits=0)}/{ms(row['oracle']['p99_s'], digits=0)} ms (wall)"
                    print(f"[quality]   {family} {load} {route} #{rep}:{extra} ok={row['ok']} 429/503={row['rejected_429']}/"
                          f"{row['rejected_503']} fail={row['failed']} ttft p50/p99={ms(row['ttft_p50'], digits=0)}/"
                          f"{ms(row['ttft_p99'], digits=0)} ms goodput={100 * row['goodput_frac']:.0f}% "
                          f"hit={fmt(row['prefix_hit'], digits=2)} preempt={row['preemptions']} "
                          + (f"holders left={row['holders_left']} " if row.get("holders_left") is not None else "")
                          + f"per worker={row['per_worker']} lag={row['engine_lag_s']:.2f}s "
                          f"({time.time() - t0:.0f} s; ETA {eta / 60:.0f} min)",
                          flush=True)
                    data["meta"]["took_s"] = time.time() - t_start
                    write_all(data, args.name, out_dir)  # a cut-short run keeps what it has
        # every repeat's TTFTs per load and route, kept as a CDF for `kvroute bench plot`
        fam["ttft_cdf"] = {load: {route_label(r): cdf(ttfts.get((load, r), [])) for r in routes} for load in loads}
    data["meta"]["took_s"] = time.time() - t_start
    print(write_all(data, args.name, out_dir))
    return 0 if not data["failed_cells"] else 1


def select_families(args: argparse.Namespace) -> tuple[list[str], dict[str, Path]]:
    """The families to run, and the trace file of each trace family. By default every generated family and every
    trace family whose file is in --trace-dir (a missing one is named, with how to get it); with --trace only
    those files, unless --families names more."""
    trace_files = {family_for_path(p): p for p in args.trace}
    if args.families is None and trace_files:
        return list(trace_files), trace_files
    if args.families is None:
        present = [f for f in TRACE_FAMILIES if trace_path(f, args.trace_dir).exists()]
        for f in TRACE_FAMILIES:
            if f not in present:
                print(f"[quality] {f} left out: no {trace_path(f, args.trace_dir)} (bench/README.md says how to "
                      f"get it)", flush=True)
        families = [*KINDS, *present]
    else:
        families = [f for f in args.families.split(",") if f]
    for f in families:
        if f in TRACE_FAMILIES:
            trace_files.setdefault(f, trace_path(f, args.trace_dir))
        elif f not in FAMILIES and f not in trace_files:
            raise SystemExit(f"unknown family {f!r}; known: {', '.join(KINDS + tuple(TRACE_FAMILIES))}, or a "
                             f"trace_* family of a --trace file")
    return families, trace_files


def family_workload(args: argparse.Namespace, family: str, trace_files: dict[str, Path],
                    vocab: BlockVocabulary | None) -> Workload | TraceWorkload:
    """A generated family's saved workload, or a trace family's window (requests that fit the engines' context)."""
    if family not in trace_files:
        return load_or_generate(family, args.seed, max(args.requests or 0, DEFAULT_REQUESTS))
    preset = get_preset(args.preset)
    # the preset's own KV: a trace's reusable blocks already overflow one worker's cache (bench/README.md)
    kv_tokens = args.kv_tokens or preset.kv_capacity_tokens
    max_context = min(preset.max_model_len, kv_tokens // preset.block_size * preset.block_size)
    return load_window(family, trace_files[family], args.trace_start, args.trace_duration or None, max_context,
                       kv_tokens, MODEL_A, vocab or BlockVocabulary())


def write_all(data: dict[str, Any], name: str, out_dir: Path | None) -> str:
    write_json(results_path(name, ".json", out_dir), data)
    text = render(data)
    results_path(name, ".md", out_dir).write_text(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
