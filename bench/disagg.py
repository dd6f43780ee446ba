"""`kvroute bench disagg` (issue 32): disaggregated serving side by side on one sim fleet of 8 GPUs and one workload.

Owns the matrix (family x route x repeat) and each cell's measurement. A route is a fleet shape and a router over
it: `aggregated` (8 x both, kvroute's default policy), `kvroute-split:2p6d` (2 prefill + 6 decode workers, kvroute
splitting every request: fixed P/D), `kvroute:2p6d` (the same fleet, kvroute's conditional disaggregation: a request
is split only when that is predicted sooner; `kvroute-whole:2p6d` with `disagg.whole_on_prefill`), `kvroute:8flex`
(8 both workers whose connectors send and receive: no fixed pools, a request split over two of them only when
predicted sooner), `vllm-router:2p6d` (vllm-router 0.1.17's PD mode over the same workers, NIXL protocol). Times are simulated seconds (wall x time scale). Figures per load: TTFT and inter-token
latency (each gap between two tokens of a stream) p50/p99, the per-request mean inter-token latency (TPOT) p99, SLO
attainment (the share of requests meeting TTFT <= --ttft-slo and TPOT <= --itl-slo), throughput, KV moved between
workers, the share of requests split, and the sims' engine lag (how far they fell behind the wall clock: ~0 means
the host kept up).

Goodput, in each mode:
- without --sweep, every cell runs on a fresh fleet (empty caches, zeroed counters) at the family's one offered
  rate (RATES, --rate), and goodput is that rate x the SLO attainment. Where every route meets the SLO it is the
  offered rate for all of them: it cannot say which serves more.
- with --sweep M1,M2,..., goodput is DistServe's: the highest offered rate at which at least --attainment (90%) of
  requests meet the SLO. Per (family, route, repeat) one fresh fleet and router run the family's rate x each
  multiplier in increasing order, each step's prompts salted anew (cold caches) and the fleet idle before it,
  until the first step below the target; the sustained rate is the last passing step's rate before it (0 when
  the first fails). The rules: disagg_sweep.py.
Tables: disagg_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from bench.disagg_report import render
from bench.disagg_sweep import (
    ATTAINMENT,
    parse_multipliers,
    run_steps,
    salted,
    sustained_record,
    wait_until_idle,
)
from bench.disagg_workloads import FAMILIES, KINDS, load_or_generate
from bench.fleet import Fleet, SimWorkerSpec, free_port, resolve_default, start_kvroute
from bench.loadgen import LoadGenerator, RequestSpec, RunResult, percentile
from bench.peers import RunningRouter, ensure_installed, spawn, wait_ready
from bench.procstat import ProcessTree
from bench.report import environment_note, results_path, write_json
from bench.workloads import Workload

PRESET = "h100-qwen3-vl-8b"
WORKERS = 8
REPEATS = 3
# (prefill, decode) workers; "8flex": 8 both workers whose connectors send and receive (kv_both), kvroute splitting
# a request over two of them when that is predicted sooner (proxy/routing/flexible.py)
SHAPES = {"8both": (0, 0), "8flex": (0, 0), "2p6d": (2, 6), "3p5d": (3, 5), "4p4d": (4, 4)}
ROUTES = ("aggregated", "kvroute-split:2p6d", "kvroute-split:3p5d", "kvroute-split:4p4d", "kvroute:2p6d",
          "kvroute:3p5d", "vllm-router:2p6d", "vllm-router:3p5d")
# offered load per family, requests per simulated second: the aggregated fleet near its ITL limit (bench/README.md)
RATES = {"long_prompt": 14.0, "mixed_images": 30.0, "multi_turn": 24.0}
LINK = "rdma-400g"


def shape_of(route: str) -> tuple[str, str, str]:
    """(router, fleet shape, kvroute policy spec) of a route name."""
    if route == "aggregated":
        return "kvroute", "8both", "default"
    router, _, shape = route.partition(":")
    if shape not in SHAPES or shape == "8both":
        raise ValueError(f"route {route!r}: the shape after ':' is one of {', '.join(s for s in SHAPES if s != '8both')}")
    if router == "kvroute-split":
        return "kvroute", shape, "default@disagg.split=always"
    if router == "kvroute-whole":
        return "kvroute", shape, "default@disagg.whole_on_prefill=true"
    if router == "kvroute-seconds":  # the stall counted in request-seconds (the rule before 2026-12-05)
        return "kvroute", shape, "default@disagg.stall_cost=request_seconds"
    if shape == "8flex" and router != "kvroute":
        raise ValueError(f"route {route!r}: shape 8flex is kvroute's alone (kvroute:8flex)")
    if router in ("kvroute", "vllm-router"):
        return router, shape, "default"
    raise ValueError(f"unknown route {route!r}: aggregated, kvroute:SHAPE, kvroute-split:SHAPE, kvroute-whole:SHAPE, "
                     "kvroute-seconds:SHAPE or vllm-router:SHAPE")


def fleet_specs(shape: str, time_scale: float, preset: str) -> list[SimWorkerSpec]:
    prefill, decode = SHAPES[shape]

    def kv(role: str, kv_role: str) -> list[str]:
        return ([] if role == "both" else ["--role", role]) + [
            "--kv-transfer", json.dumps({"connector": "NixlConnector", "kv_role": kv_role, "link": LINK})]

    if shape == "8flex":
        return [SimWorkerSpec("qwen3-vl-8b", preset, time_scale, kv("both", "kv_both")) for _ in range(WORKERS)]
    if not prefill:
        return [SimWorkerSpec(model="qwen3-vl-8b", preset=preset, time_scale=time_scale) for _ in range(WORKERS)]

    return ([SimWorkerSpec("qwen3-vl-8b", preset, time_scale, kv("prefill", "kv_producer")) for _ in range(prefill)]
            + [SimWorkerSpec("qwen3-vl-8b", preset, time_scale, kv("decode", "kv_consumer")) for _ in range(decode)])


def start_vllm_router(fleet: Fleet, shape: str, log_dir: Path) -> RunningRouter:
    """vllm-router's PD mode over the fleet: its prefill and decode workers by URL, NIXL's protocol."""
    venv = ensure_installed("vllm-router")
    prefill, _ = SHAPES[shape]
    port, metrics_port = free_port(), free_port()
    args = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
            *(a for u in fleet.urls[:prefill] for a in ("--prefill", u)),
            *(a for u in fleet.urls[prefill:] for a in ("--decode", u)),
            "--kv-connector", "nixl", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warning"]
    log_path = log_dir / f"vllm-router-pd-{port}.log"
    popen = spawn(args, log_path)
    router = RunningRouter(f"vllm-router:pd-{shape}", f"http://127.0.0.1:{port}", popen, log_path,
                           ProcessTree(popen.pid))
    try:
        wait_ready(router.url, popen, log_path, path="/health")
    except BaseException:
        router.stop()
        raise
    return router


@contextmanager
def serving(args: argparse.Namespace, route: str, log_dir: Path) -> Iterator[tuple[Fleet, RunningRouter]]:
    """A fresh fleet shaped by the route and its router over it, stopped on the way out."""
    router_kind, shape, policy = shape_of(route)
    with Fleet(log_dir, fleet_specs(shape, args.time_scale, args.preset)) as fleet:
        router = start_kvroute(fleet, resolve_default(policy)) if router_kind == "kvroute" else \
            start_vllm_router(fleet, shape, log_dir)
        try:
            yield fleet, router
        finally:
            router.stop()


def measure_load(args: argparse.Namespace, fleet: Fleet, router: RunningRouter, route: str,
                 specs: list[RequestSpec], cell: str = "") -> dict[str, Any]:
    """Send `specs` open loop through the router; the figures of that load (sim counters as deltas). With --dump,
    each request's outcome is appended there, labelled `cell`."""
    before = fleet.sim_states()
    cpu0 = router.tree.cpu_seconds()
    run = asyncio.run(LoadGenerator(router.url, record_gaps=True).open_loop(specs, gap_scale=1.0))
    router_cpu = (router.tree.cpu_seconds() - cpu0) / run.wall_s
    after = fleet.sim_states()
    row = measure(run, before, after, SHAPES[shape_of(route)[1]][0], args.time_scale, args.ttft_slo, args.itl_slo)
    row["router_cpu"] = router_cpu
    if args.dump is not None:
        dump_requests(args.dump, cell or route, run, args.time_scale)
    return row


def dump_requests(path: Path, cell: str, run: RunResult, ts: float) -> None:
    """One JSON line per request: its cell, workload part, workers (prefill,decode for a split), prompt and output
    tokens, TTFT and TPOT in simulated seconds, HTTP status: what a cell's goodput is made of."""
    def sim(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * ts, 6)

    with path.open("ab") as out:
        for r in run.results:
            out.write(orjson.dumps({"cell": cell, "tag": r.tag, "worker": r.worker, "prompt_tokens": r.prompt_tokens,
                                    "completion_tokens": r.completion_tokens, "sent_s": sim(r.sent_at),
                                    "ttft_s": sim(r.ttft_s), "tpot_s": sim(r.itl_s), "status": r.status}) + b"\n")


def family_rate(args: argparse.Namespace, family: str) -> float:
    """The family's offered rate, requests per simulated second (--rate over RATES)."""
    return args.rate.get(family, RATES[family])


def run_cell(args: argparse.Namespace, w: Workload, family: str, route: str, salt: str, log_dir: Path) -> dict[str, Any]:
    rate = family_rate(args, family)
    with serving(args, route, log_dir) as (fleet, router):
        row = measure_load(args, fleet, router, route, w.specs(rate * args.time_scale, salt=salt, limit=args.requests),
                           salt)
    # goodput: the offered rate the route served within the SLO (every route is offered the same arrivals)
    row.update(family=family, route=route, rate=rate, goodput_per_s=rate * row["goodput_frac"])
    return row


def run_sweep_cell(args: argparse.Namespace, w: Workload, family: str, route: str, repeat: int, log_dir: Path,
                   steps: list[dict[str, Any]]) -> None:
    """One fleet and router for every multiplier of --sweep, in increasing order, each step's prompts salted anew,
    the fleet idle before each; stops after the first step below --attainment. Appends each step's row to
    `steps` as it is measured (a later step's failure keeps the earlier ones)."""
    base = family_rate(args, family)
    with serving(args, route, log_dir) as (fleet, router):
        def step(multiplier: float) -> dict[str, Any]:
            idle_wait_s = wait_until_idle(fleet)
            rate = base * multiplier
            salt = f"{family}-{route}-{repeat}-x{multiplier:g}-{time.time()}"
            specs = salted(w.specs(rate * args.time_scale, salt=salt, limit=args.requests), salt)
            row = measure_load(args, fleet, router, route, specs, f"{family} {route} #{repeat} x{multiplier:g}")
            row.update(family=family, route=route, repeat=repeat, multiplier=multiplier, rate=rate,
                       attainment=row["goodput_frac"], goodput_per_s=rate * row["goodput_frac"],
                       idle_wait_s=idle_wait_s)
            busy = " (the fleet was still busy at the idle deadline)" if idle_wait_s < 0 else ""
            print(f"[disagg] {family} {route} #{repeat} x{multiplier:g} ({rate:g}/s): attainment="
                  f"{100 * row['attainment']:.0f}% {_figures(row)}{busy}", flush=True)
            return row

        run_steps(args.sweep, args.attainment, step, steps.append)


def measure(run: RunResult, before: list[dict], after: list[dict], prefill_workers: int, ts: float,
            ttft_slo: float, itl_slo: float) -> dict[str, Any]:
    """A cell's figures in simulated seconds (see the module docstring)."""
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft_s * ts for r in ok if r.ttft_s is not None]
    tpot = [r.itl_s * ts for r in ok if r.itl_s is not None]
    gaps = [g * ts for r in ok for g in (r.gaps or ())]
    wall = run.wall_s * ts
    good = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s * ts <= ttft_slo
               and (r.itl_s is None or r.itl_s * ts <= itl_slo))

    def delta(key: str, sub: str | None = None) -> list[float]:
        def get(state: dict) -> float:
            value = state.get(sub, {}) if sub else state
            return float(value.get(key, 0) or 0)
        return [get(a) - get(b) for b, a in zip(before, after, strict=True)]

    received = delta("requests_received")
    split = sum(received[:prefill_workers])
    return {
        "requests": len(run.results), "ok": len(ok), "failed": len(run.results) - len(ok),
        "errors": sorted({r.error for r in run.results if r.error})[:3],
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
        "goodput_frac": good / len(run.results) if run.results else 0.0,
        "req_per_s": len(ok) / wall if wall else 0.0,
        "output_tok_per_s": sum(r.completion_tokens for r in ok) / wall if wall else 0.0,
        "kv_moved_gb": sum(delta("bytes_received", "kv_transfer")) / 1e9,
        "transfers": int(sum(delta("transfers_received", "kv_transfer"))),
        "split_share": (split if prefill_workers else sum(delta("transfers_received", "kv_transfer"))) / len(ok)
        if ok else 0.0,
        "prefix_hit": _hit(delta("prefix_cache_hits"), delta("prefix_cache_queries")),
        "engine_lag_s": max(delta("lag_sim_s"), default=0.0), "wall_s": wall,
        "held_at_end": int(sum(float(a.get("blocks_held_for_transfer", 0)) for a in after)),
    }


def _hit(hits: list[float], queries: list[float]) -> float | None:
    return sum(hits) / sum(queries) if sum(queries) else None


# requests per fixed-rate cell, and per sweep step: at 160 a step at 3x the mixed family's rate lasts 1.8 simulated
# seconds, a burst that a fleet sustaining 60 req/s absorbed at 93% attainment (bench/results/2026-12-04-disagg-sweep-
# mixed.md against 2026-12-04-disagg-sweep-mixed-480.md)
FIXED_REQUESTS, SWEEP_REQUESTS = 160, 480


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument("--routes", default=",".join(ROUTES),
                   help="comma-separated: aggregated, kvroute:SHAPE (conditional), kvroute-split:SHAPE (always "
                        "split), kvroute-whole:SHAPE (conditional, prefill workers also run whole requests: "
                        "disagg.whole_on_prefill), kvroute-seconds:SHAPE (conditional, disagg.stall_cost="
                        "request_seconds), vllm-router:SHAPE (its PD mode); SHAPE 2p6d, 3p5d or 4p4d, or 8flex "
                        "(kvroute only)")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per cell (default {FIXED_REQUESTS}), or per step of --sweep (default {SWEEP_REQUESTS}: a "
                        "step must outlast the queue it builds, or it measures a burst the fleet absorbs)")
    p.add_argument("--time-scale", type=float, default=0.25,
                   help="sim time scale, the same for every route (below 1 when the host cannot keep 8 sims up)")
    p.add_argument("--rate", default="", help="FAMILY=REQ_PER_SIMULATED_S,... over the defaults "
                                              f"({', '.join(f'{k}={v:g}' for k, v in RATES.items())})")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--preset", default=PRESET)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput: time to first token, simulated seconds")
    p.add_argument("--itl-slo", type=float, default=0.05, help="goodput: mean inter-token latency, simulated seconds")
    p.add_argument("--sweep", default="",
                   help="M1,M2,...: goodput as the highest sustainable rate. Per (family, route, repeat) one fleet runs "
                        "the family's rate x each multiplier in increasing order (fresh prompts each step) until the "
                        "first step below --attainment; empty: one cell per route at the family's rate")
    p.add_argument("--attainment", type=float, default=ATTAINMENT,
                   help="--sweep: the share of requests that must meet both SLOs for a step to pass")
    p.add_argument("--name", default="disagg", help="result file name after the date")
    p.add_argument("--out-dir", type=Path, default=None, help="default bench/results/")
    p.add_argument("--dump", type=Path, default=None,
                   help="append one JSON line per request (cell, workers, tokens, TTFT, TPOT) to this file")
    p.add_argument("--render", type=Path, default=None, help="only regenerate the markdown from this JSON file")


def run(args: argparse.Namespace) -> int:
    if args.render:
        args.render.with_suffix(".md").write_text(render(json.loads(args.render.read_text())))
        print(args.render.with_suffix(".md"))
        return 0
    args.rate = {k: float(v) for k, v in (item.split("=") for item in args.rate.split(",") if item)}
    args.sweep = parse_multipliers(args.sweep)
    if args.requests is None:
        args.requests = SWEEP_REQUESTS if args.sweep else FIXED_REQUESTS
    if not 0 < args.attainment <= 1:
        raise SystemExit(f"--attainment {args.attainment}: a share of requests, above 0 and at most 1")
    families = [f for f in args.families.split(",") if f]
    routes = [r for r in args.routes.split(",") if r]
    for route in routes:
        shape_of(route)
    data = new_result(args, families)
    log_dir = Path(__file__).resolve().parent / ".runs" / f"disagg-{int(time.time())}"
    started = time.time()
    total, done = len(families) * len(routes) * args.repeats, 0
    for family in families:
        w = load_or_generate(family, args.seed, args.requests)
        for rep in range(args.repeats):  # repeats outermost: drift on the machine spreads over every route
            for route in routes:
                t0 = time.time()
                cell_dir = log_dir / family / f"{route.replace(':', '-')}-{rep}"
                try:
                    summary = (run_sweep(args, data, w, family, route, rep, cell_dir) if args.sweep
                               else run_fixed(args, data, w, family, route, rep, cell_dir))
                except Exception as exc:  # one broken router must not cost the other cells
                    print(f"[disagg] {family} {route} #{rep} FAILED: {exc}", flush=True)
                    data["failed_cells"].append(f"{family} {route} #{rep}: {str(exc)[:300]}")
                    continue
                finally:
                    done += 1
                    data["meta"]["took_s"] = time.time() - started
                    write_json(results_path(args.name, ".json", args.out_dir), data)
                    results_path(args.name, ".md", args.out_dir).write_text(render(data))
                eta = (time.time() - started) / done * (total - done)
                print(f"[disagg] {family} {route} #{rep}: {summary} ({time.time() - t0:.0f}s, ETA {eta / 60:.0f} min)",
                      flush=True)
    print(render(data))
    return 0 if not data["failed_cells"] else 1


def new_result(args: argparse.Namespace, families: list[str]) -> dict[str, Any]:
    """The result file's skeleton: its meta (a sweep run adds its multipliers and target), no rows yet."""
    meta: dict[str, Any] = {
        "environment": environment_note(), "command": "kvroute bench disagg " + shlex.join(
            sys.argv[sys.argv.index("disagg") + 1:] if "disagg" in sys.argv else sys.argv[1:]),
        "workers": WORKERS, "preset": args.preset, "time_scale": args.time_scale, "requests": args.requests,
        "repeats": args.repeats, "ttft_slo": args.ttft_slo, "itl_slo": args.itl_slo, "link": LINK,
        "families": {f: FAMILIES[f] for f in families}, "took_s": 0.0}
    data: dict[str, Any] = {"meta": meta, "rows": [], "failed_cells": []}
    if args.sweep:
        meta.update(sweep=args.sweep, attainment=args.attainment,
                    rates={f: family_rate(args, f) for f in families})
        data["sustained"] = []
    return data


def run_fixed(args: argparse.Namespace, data: dict[str, Any], w: Workload, family: str, route: str, rep: int,
              cell_dir: Path) -> str:
    """One cell at the family's rate on a fresh fleet; its row into `data`, a line for the log."""
    row = run_cell(args, w, family, route, f"{family}-{route}-{rep}-{time.time()}", cell_dir)
    row["repeat"] = rep
    data["rows"].append(row)
    return f"{_figures(row)} goodput={row['goodput_per_s']:.2f}/s"


def run_sweep(args: argparse.Namespace, data: dict[str, Any], w: Workload, family: str, route: str, rep: int,
              cell_dir: Path) -> str:
    """One sweep on one fleet; its steps and sustained rate into `data` (the steps even when a later one
    raised), a line for the log."""
    steps: list[dict[str, Any]] = []
    try:
        run_sweep_cell(args, w, family, route, rep, cell_dir, steps)
    finally:
        data["rows"] += steps
    record = sustained_record(family, route, rep, steps, args.attainment)
    data["sustained"].append(record)
    return f"sustained {record['sustained_rate']:g} req/s over {record['steps']} steps"


def _figures(row: dict[str, Any]) -> str:
    return (f"ok={row['ok']}/{row['requests']} ttft p50/p99={row['ttft_p50'] or 0:.2f}/{row['ttft_p99'] or 0:.2f}s "
            f"itl p50/p99={1000 * (row['itl_p50'] or 0):.0f}/{1000 * (row['itl_p99'] or 0):.0f}ms tpot p99="
            f"{1000 * (row['tpot_p99'] or 0):.0f}ms split={100 * row['split_share']:.0f}% "
            f"kv={row['kv_moved_gb']:.1f}GB lag={row['engine_lag_s']:.2f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
