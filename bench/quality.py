"""Routing-quality benchmark (issue 9): kvroute's default vs its other policies, the peers and an oracle.

Owns the matrix (family x load x route x repeat), capacity calibration, per-cell measurement from the
sims' own state, aggregation (mean and spread over repeats) and the result files; processes come from
fleet.py, load from loadgen.py, workloads from workloads.py, the oracle from oracle.py.

Every cell runs on a FRESH fleet (new sim processes: empty caches, zeroed counters) and a fresh router.
Engine-side figures (prefix-cache hits, preemptions, requests per worker) are deltas of each sim's
GET /sim/state around the cell. Times are simulated seconds (wall x time scale; 1 by default).
The markdown is generated from the JSON (`--render FILE.json` regenerates it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.fleet import Fleet, SimWorkerSpec, default_policy, start_router
from bench.loadgen import LoadGenerator, RunResult, summarize
from bench.report import cdf, environment_note, fmt, md_table, ms, results_path, write_json
from bench.tails import cold_start, save_requests, ttft_p99_after_first_wave
from bench.workloads import DEFAULT_REQUESTS, FAMILIES, KINDS, Workload, load_or_generate

ROUTES = ("kvroute:default", "kvroute:kv_aware", "kvroute:round_robin", "oracle",
          "sglang-router:cache_aware", "sglang-router:power_of_two",
          "vllm-router:cache_aware", "vllm-router:power_of_two", "lmdeploy:min_expected_latency")
LOADS = ("closed", "0.5", "0.8", "0.95", "1.1")
PEERS = ("sglang-router", "vllm-router", "lmdeploy")
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


def fleet_specs(w: Workload, workers: int, time_scale: float, preset: str, kv_tokens: int | None) -> list[SimWorkerSpec]:
    extra = ["--kv-capacity-tokens", str(kv_tokens or w.kv_tokens)]
    return [SimWorkerSpec(model=m, preset=preset, time_scale=time_scale, extra=extra)
            for m in w.worker_models_for(workers)]


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


def run_cell(args: argparse.Namespace, w: Workload, route: str, load: str, rate_wall: float, salt: str,
             log_dir: Path) -> dict[str, Any]:
    """One (route, load) run on a fresh fleet; times in simulated seconds."""
    kind, _, policy = route.partition(":")
    with Fleet(log_dir, fleet_specs(w, args.workers, args.time_scale, args.preset, args.kv_tokens)) as fleet:
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
               oracle_decision_p50_s=(oracle_stats or {}).get("p50_s"),
               makespan_s=max(done) if done else None,
               ttfts=[r.ttft_s for r in run.results if r.ok and r.ttft_s is not None])
    return row


def _oracle_stats(url: str) -> dict[str, Any] | None:
    from bench.peers import _get

    status, body = _get(url + "/oracle/stats", 5.0)
    return json.loads(body) if status == 200 else None


def calibrate(args: argparse.Namespace, w: Workload, log_dir: Path) -> tuple[float, dict[str, float]]:
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


def _calibrate_one(args: argparse.Namespace, w: Workload, route: str, log_dir: Path) -> float:
    kind, _, policy = route.partition(":")
    with Fleet(log_dir, fleet_specs(w, args.workers, args.time_scale, args.preset, args.kv_tokens)) as fleet:
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


# ---- aggregation and rendering (from the JSON alone) ------------------------------------------------
METRICS = ("req_per_s", "makespan_s", "ttft_p50", "ttft_p99", "goodput_frac", "rejected_429", "rejected_503",
           "failed", "prefix_hit", "prefill_tokens", "preemptions", "engine_lag_s", "router_cpu", "oracle_decision_p50_s",
           "ttft_p99_warm", "lat_p99", "ttft_p99_seen", "cold_in_slowest_1pct", "cold_first_uses")


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (family, load, route): mean, min and max of each metric over the repeats."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["load"], r["route"]), []).append(r)
    out = []
    for (family, load, route), rs in groups.items():
        agg: dict[str, Any] = {"family": family, "load": load, "route": route, "label": rs[0].get("label", route),
                               "repeats": len(rs)}
        for m in METRICS:
            xs = [r[m] for r in rs if r.get(m) is not None]
            agg[m] = (statistics.fmean(xs), min(xs), max(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) \
                if xs else None
        per = [r["per_worker"] for r in rs if r.get("per_worker")]
        agg["per_worker"] = [round(statistics.fmean(col)) for col in zip(*per, strict=True)] if per else []
        out.append(agg)
    return out


def _mean(a: dict[str, Any], m: str) -> float | None:
    return a[m][0] if a.get(m) else None


def _cell(a: dict[str, Any], m: str, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
    v = a.get(m)
    if not v:
        return "-"
    mean, lo, hi, _ = (x * scale for x in v)
    if a["repeats"] < 2 or lo == hi:
        return f"{mean:.{digits}f}{unit}"
    return f"{mean:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def best_oracle(cell: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The oracle route of a cell with the lowest TTFT p99 (`oracle`, `oracle:kv_aware` and
    `oracle:kv_aware_owner` score differently)."""
    oracles = [a for a in cell if a["route"].split(":")[0] == "oracle" and _mean(a, "ttft_p99") is not None]
    return min(oracles, key=lambda a: _mean(a, "ttft_p99") or 0.0, default=None)


def verdicts(aggs: list[dict[str, Any]]) -> list[list[str]]:
    """Issue 9's bar per (family, load): kvroute's default against the best peer and the oracle (means)."""
    out = []
    keys = sorted({(a["family"], a["load"]) for a in aggs}, key=lambda k: (k[0], k[1] != "closed", k[1]))
    for family, load in keys:
        cell = [a for a in aggs if a["family"] == family and a["load"] == load]
        mine = next((a for a in cell if a["route"] == "kvroute:default"), None)
        peers = [a for a in cell if a["route"].split(":")[0] in PEERS]
        oracle = best_oracle(cell)
        if mine is None or not peers:
            continue
        misses = []
        # A peer that failed or refused requests ends its makespan early and leaves the hard requests out of
        # its percentiles: it is not the bar for speed while another peer served everything.
        served_all = [p for p in peers if not _lost(p)]
        if served_all and len(served_all) < len(peers):
            misses.append("(not compared: " + ", ".join(
                f"{p['route']}, which lost {_lost(p):.0f} requests per run" for p in peers if _lost(p)) + ")")
            peers = served_all
        rate = "makespan_s" if load == "closed" else "req_per_s"
        best_rate = (min if rate == "makespan_s" else max)(_mean(p, rate) or 0 for p in peers)
        mr = _mean(mine, rate) or 0
        if (mr > best_rate * 1.0 if rate == "makespan_s" else mr < best_rate):
            misses.append(f"{'makespan' if rate == 'makespan_s' else 'throughput'} {mr:.2f} vs best peer {best_rate:.2f}")
        best_good = max(_mean(p, "goodput_frac") or 0 for p in peers)
        if (_mean(mine, "goodput_frac") or 0) < best_good:
            misses.append(f"goodput {100 * (_mean(mine, 'goodput_frac') or 0):.0f}% vs {100 * best_good:.0f}%")
        p99s = [_mean(p, "ttft_p99") for p in peers if _mean(p, "ttft_p99") is not None]
        mp99 = _mean(mine, "ttft_p99")
        if p99s and mp99 is not None and mp99 > 0.7 * min(p99s):
            misses.append(f"TTFT p99 {mp99 * 1000:.0f} ms > 0.7 x best peer's {min(p99s) * 1000:.0f} ms")
        warm = [_mean(p, "ttft_p99_warm") for p in peers if _mean(p, "ttft_p99_warm") is not None]
        mwarm = _mean(mine, "ttft_p99_warm")
        if warm and mwarm is not None:
            misses.append(f"(after the first wave: p99 {mwarm * 1000:.0f} ms vs best peer's {min(warm) * 1000:.0f} ms)")
        seen = [_mean(p, "ttft_p99_seen") for p in peers if _mean(p, "ttft_p99_seen") is not None]
        mseen, mcold = _mean(mine, "ttft_p99_seen"), _mean(mine, "cold_in_slowest_1pct")
        if seen and mseen is not None and mcold:
            misses.append(f"({mcold:.1f} of kvroute's slowest 1% are cold first uses of a shared prefix; without "
                          f"them p99 {mseen * 1000:.0f} ms vs best peer's {min(seen) * 1000:.0f} ms)")
        refused = (_mean(mine, "rejected_429") or 0) + (_mean(mine, "rejected_503") or 0)
        if refused > 0:
            misses.append(f"refused {refused:.1f} per run")
        hitters = [p for p in peers if _mean(p, "prefix_hit") is not None]
        if hitters:
            misses += _hit_miss(mine, max(hitters, key=lambda p: _mean(p, "prefix_hit") or 0.0))
        if oracle and mp99 is not None and _mean(oracle, "ttft_p99") and mp99 > 1.2 * _mean(oracle, "ttft_p99"):
            misses.append(f"p99 > 1.2 x {oracle['route']}'s {_mean(oracle, 'ttft_p99') * 1000:.0f} ms")
        others = [_mean(a, "ttft_p99") for a in cell
                  if a["route"].split(":")[0] != "oracle" and _mean(a, "ttft_p99") is not None]
        if oracle and others and (_mean(oracle, "ttft_p99") or 0) > min(others):
            misses.append(f"(the oracle is no bound here: its p99 {(_mean(oracle, 'ttft_p99') or 0) * 1000:.0f} ms > "
                          f"best route's {min(others) * 1000:.0f} ms; see its decision time and the engine lag)")
        text = "; ".join(misses)
        if not [m for m in misses if not m.startswith("(")]:
            text = "meets the bar" + (f" {text}" if text else "")
        out.append([family, _load_name(load), text])
    return out


def _hit_miss(mine: dict[str, Any], best: dict[str, Any]) -> list[str]:
    """The hit-rate miss, if any, to two decimals (gaps are often a fraction of a point) with the prefill work it
    stands for: the tokens kvroute's engines prefilled per run beyond the best peer's."""
    mh, bh = _mean(mine, "prefix_hit") or 0.0, _mean(best, "prefix_hit") or 0.0
    if mh >= bh:
        return []
    text = f"prefix hit {100 * mh:.2f}% < {100 * bh:.2f}% ({best['route']}"
    extra = (_mean(mine, "prefill_tokens") or 0.0) - (_mean(best, "prefill_tokens") or 0.0)
    if _mean(best, "prefill_tokens"):
        text += f"; {extra / 1000:+.1f}k prefilled tokens per run, {100 * extra / _mean(best, 'prefill_tokens'):+.1f}%"
    return [text + ")"]


def _lost(a: dict[str, Any]) -> float:
    """Requests per run a route did not serve: failed plus refused (429 and 503)."""
    return sum(_mean(a, m) or 0.0 for m in ("failed", "rejected_429", "rejected_503"))


def _load_name(load: str) -> str:
    return "closed loop" if load == "closed" else f"{float(load) * 100:.0f}%"


def render(data: dict[str, Any]) -> str:
    meta, aggs = data["meta"], aggregate(data["rows"])
    out = [f"# Routing quality matrix{' (QUICK RUN: NOT MEANINGFUL)' if meta['quick'] else ''}\n"]
    if meta["quick"]:
        out.append("**Quick run** (fewer than 1000 requests per cell or fewer than 3 repeats): the figures below "
                   "show that the bench runs, not how the routers compare.\n")
    out.append(f"{meta['environment']}; run took {meta['took_s']:.0f} s. Command: `{meta['command']}`\n")
    out.append(f"Fleet per cell (fresh sim processes every cell): {meta['workers']} sim workers, preset "
               f"{meta['preset']}, time scale {meta['time_scale']} (times are simulated seconds), KV per worker as "
               f"the family sets it. {meta['requests']} requests per cell, {meta['repeats']} repeats; figures are "
               f"the mean with (min-max) over repeats. Closed loop: {meta['closed_clients']} clients per worker, "
               f"the figure of merit is the makespan. Open loop: Poisson (or bursty) arrivals at the given fraction "
               f"of capacity = the best steady-state closed-loop throughput among `{meta['calibrate_routes']}`. "
               f"Goodput = share of all requests (refused ones included) with TTFT <= {meta['ttft_slo']:g} s. "
               f"Prefix hit, prefilled tokens, preemptions and requests per worker are the engines' own counters "
               f"(/sim/state deltas). p99 after 1st wave (closed loop) = TTFT p99 of the requests sent after the "
               f"first response finished: the loop's steady tail, without every client's first request onto the cold "
               f"fleet at once (~13% of a cell, so the cell's p99 is that cold start's). Cold first uses = the "
               f"requests that were first to present their shared prefix (system prompt, or system prompt + image; "
               f"each cell salts them, so it starts cold): they prefill it wherever they go; the columns give how "
               f"many are among the cell's slowest 1% of TTFTs (what its p99 is made of) and the TTFT p99 of the "
               f"other requests. End-to-end p99 = p99 of "
               f"the time from sending a request to its last byte (decode included). Router CPU = share of one core; engine lag = simulated seconds the busiest sim fell "
               f"behind the wall clock (CPU starvation; should be ~0). kvroute's default policy: "
               f"`{meta['default_policy']}`.\n")
    if meta.get("warm"):
        out.append("**Warm cells** (`--warm`): before each cell's measured run the router got every shared prefix "
                   "once (system prompt and image, the question \"warm up\", one output token, one at a time), so "
                   "no measured request is a cold first use; the engines' counters and every figure exclude them.\n")
    v = verdicts(aggs)
    if v:
        out.append("## kvroute default vs issue 9's bar (best peer; oracle)\n")
        out.append(md_table(["family", "load", "verdict"], v))
        out.append("")
    for family in [f for f in KINDS if any(a["family"] == f for a in aggs)]:
        fam = meta["families"].get(family, {})
        out.append(f"## ({FAMILIES[family][0]}) {family}: {FAMILIES[family][1]}\n")
        out.append(f"KV per worker {fam.get('kv_tokens')} tokens; shared prefixes {fam.get('shared_prefix_tokens')} "
                   f"tokens; capacity {fmt(fam.get('capacity'), ' req/s', 2)} (simulated; by calibration route: "
                   f"{', '.join(f'{r} {c:.2f}' for r, c in fam.get('capacity_by_route', {}).items()) or '-'}).\n")
        rows = []
        cell = sorted((a for a in aggs if a["family"] == family),
                      key=lambda a: (a["load"] != "closed", a["load"], a["route"]))
        for a in cell:
            label = a["label"] if not a.get("oracle_decision_p50_s") else \
                f"{a['label']} (decision p50 {_cell(a, 'oracle_decision_p50_s', 1000)} ms wall)"
            rows.append([_load_name(a["load"]), label, a["repeats"],
                         _cell(a, "makespan_s", digits=1) if a["load"] == "closed" else _cell(a, "req_per_s", digits=2),
                         _cell(a, "ttft_p50", 1000), _cell(a, "ttft_p99", 1000), _cell(a, "ttft_p99_warm", 1000),
                         _cell(a, "ttft_p99_seen", 1000), _cell(a, "cold_in_slowest_1pct", digits=1),
                         _cell(a, "lat_p99", 1000), _cell(a, "goodput_frac", 100, 0, "%"), f"{_cell(a, 'rejected_429')}/{_cell(a, 'rejected_503')}", _cell(a, "failed"),
                         _cell(a, "prefix_hit", 100, 0, "%"), _cell(a, "prefill_tokens", 1e-3, 0, "k"),
                         _cell(a, "preemptions"), "/".join(str(x) for x in a["per_worker"]),
                         _cell(a, "router_cpu", 100, 0, "%"), _cell(a, "engine_lag_s", digits=2)])
        out.append(md_table(["load", "route", "reps", "makespan s (closed) / req/s (open)", "TTFT p50 ms",
                             "TTFT p99 ms", "p99 after 1st wave", "p99 without cold first uses",
                             "cold first uses in slowest 1%", "end-to-end p99 ms", "goodput", "429/503", "failed", "prefix hit", "prefilled",
                             "preempt", "requests per worker", "router CPU", "engine lag s"], rows))
        out.append("")
        for failure in data.get("failed_cells", []):
            if failure.startswith(family + " "):
                out.append(f"- cell not run: {failure}")
        if fam.get("ttft_cdf"):
            out.append("TTFT CDFs per load: `kvroute bench plot` on the JSON beside this file.")
        out.append("")
    return "\n".join(out)


def headline(data: dict[str, Any]) -> str:
    """The headline of a quality result: per family and load, kvroute's default next to the best peer and the
    oracle (means over repeats), then the verdicts. Generated from the JSON only."""
    aggs = aggregate(data["rows"])
    meta = data["meta"]
    rows = []
    for family in [f for f in KINDS if any(a["family"] == f for a in aggs)]:
        for load in sorted({a["load"] for a in aggs if a["family"] == family}, key=lambda x: (x != "closed", x)):
            cell = [a for a in aggs if a["family"] == family and a["load"] == load]
            mine = next((a for a in cell if a["route"] == "kvroute:default"), None)
            peers = [a for a in cell if a["route"].split(":")[0] in PEERS]
            best = max(peers, key=lambda a: (_mean(a, "goodput_frac") or 0, -(_mean(a, "ttft_p99") or 1e9)),
                       default=None)
            oracle = best_oracle(cell)
            merit = "makespan_s" if load == "closed" else "req_per_s"

            def brief(a: dict[str, Any] | None, merit: str = merit) -> list[str]:
                if a is None:
                    return ["-"] * 5
                return [_cell(a, merit, digits=1 if merit == "makespan_s" else 2), _cell(a, "ttft_p99", 1000),
                        _cell(a, "ttft_p99_warm", 1000), _cell(a, "goodput_frac", 100, 0, "%"),
                        _cell(a, "prefix_hit", 100, 0, "%")]
            rows.append([family, _load_name(load), *brief(mine), best["route"] if best else "-", *brief(best),
                         *brief(oracle)[:2]])
    head = ["family", "load", "kvroute makespan s / req/s", "p99 ms", "p99 after 1st wave", "goodput", "hit",
            "best peer (goodput)", "peer makespan s / req/s", "p99 ms", "p99 after 1st wave", "goodput", "hit",
            "oracle makespan s / req/s",
            "oracle p99 ms"]
    text = [f"Routing quality matrix{' (QUICK RUN: NOT MEANINGFUL)' if meta['quick'] else ''}: {meta['environment']}. "
            f"`{meta['command']}`; {meta['requests']} requests per cell, {meta['repeats']} repeats (mean, "
            f"min-max), fresh fleet of {meta['workers']} `{meta['preset']}` sims per cell at time scale "
            f"{meta['time_scale']}; kvroute default = `{meta['default_policy']}`; TTFT in simulated ms; goodput = "
            f"TTFT <= {meta['ttft_slo']:g} s; hit = engines' prefix-cache hit rate; p99 after 1st wave (closed loop) = "
            f"without every client's first request onto the cold fleet.\n",
            md_table(head, rows), "", "Against issue 9's bar:\n", md_table(["family", "load", "verdict"],
                                                                            verdicts(aggs))]
    return "\n".join(text)


# ---- command line --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument("--loads", default=",".join(LOADS), help="'closed' and/or fractions of measured capacity")
    p.add_argument("--routes", default=",".join(ROUTES),
                   help="comma-separated kind:policy; kind kvroute (policy 'default' = ProxyConfig's), oracle (policy ttft, kv_aware or kv_aware_owner), "
                        "direct (client-side round robin) or a peer (sglang-router, vllm-router, lmdeploy)")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per cell")
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
    families = [f for f in args.families.split(",") if f]
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    routes = [r for r in args.routes.split(",") if r]
    for f in families:
        if f not in FAMILIES:
            raise SystemExit(f"unknown family {f!r}; known: {', '.join(KINDS)}")
    if args.name is None:
        args.name = "quality-matrix" + ("" if set(families) == set(KINDS) else "-" + "+".join(families))
    quick = is_quick(args.requests, args.repeats)
    out_dir = args.out_dir or (QUICK_DIR if quick else None)
    import shlex
    import sys

    data: dict[str, Any] = {"meta": {
        "quick": quick, "environment": environment_note(), "command": "kvroute bench quality " +
        shlex.join(sys.argv[sys.argv.index("quality") + 1:] if "quality" in sys.argv else sys.argv[1:]),
        "workers": args.workers, "preset": args.preset, "time_scale": args.time_scale, "requests": args.requests,
        "repeats": args.repeats, "closed_clients": args.closed_clients, "calibrate_routes": args.calibrate_routes,
        "ttft_slo": args.ttft_slo, "default_policy": default_policy(), "warm": args.warm, "families": {}, "took_s": 0.0},
        "rows": [], "failed_cells": []}
    log_dir = Path(__file__).resolve().parent / ".runs" / f"quality-{int(time.time())}"
    t_start = time.time()
    total = len(families) * len(routes) * len(loads) * args.repeats
    done_cells = 0
    for family in families:
        w = load_or_generate(family, args.seed, max(args.requests, DEFAULT_REQUESTS))
        fam: dict[str, Any] = {"kv_tokens": args.kv_tokens or w.kv_tokens,
                               "shared_prefix_tokens": w.shared_prefix_tokens(), "ttft_cdf": {}}
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
                    data["rows"].append(row)
                    eta = (time.time() - t_start) / done_cells * (total - done_cells)
                    extra = "" if not row.get("oracle") else \
                        f" oracle decision p50/p99={ms(row['oracle']['p50_s'], digits=0)}/{ms(row['oracle']['p99_s'], digits=0)} ms (wall)"
                    print(f"[quality]   {family} {load} {route} #{rep}:{extra} ok={row['ok']} 429/503={row['rejected_429']}/"
                          f"{row['rejected_503']} fail={row['failed']} ttft p50/p99={ms(row['ttft_p50'], digits=0)}/"
                          f"{ms(row['ttft_p99'], digits=0)} ms goodput={100 * row['goodput_frac']:.0f}% "
                          f"hit={fmt(row['prefix_hit'], digits=2)} preempt={row['preemptions']} "
                          f"per worker={row['per_worker']} lag={row['engine_lag_s']:.2f}s "
                          f"({time.time() - t0:.0f} s; ETA {eta / 60:.0f} min)",
                          flush=True)
                    data["meta"]["took_s"] = time.time() - t_start
                    write_all(data, args.name, out_dir)  # a cut-short run keeps what it has
        # every repeat's TTFTs per load and route, kept as a CDF for `kvroute bench plot`
        fam["ttft_cdf"] = {load: {route_label(r): cdf(ttfts.get((load, r), [])) for r in routes} for load in loads}
    data["meta"]["took_s"] = time.time() - t_start
    print(write_all(data, args.name, out_dir))
    return 0 if not data["failed_cells"] else 1


def write_all(data: dict[str, Any], name: str, out_dir: Path | None) -> str:
    write_json(results_path(name, ".json", out_dir), data)
    text = render(data)
    results_path(name, ".md", out_dir).write_text(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
