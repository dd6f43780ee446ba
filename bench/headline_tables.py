"""The tables docs/performance.md and the README build from quality and overhead result files (bench/headline.py).

Owns how a `kvroute bench quality` or `kvroute bench overhead` result becomes a markdown table (mean and min-max
over its repeats, the best peer per cell); it reads no file and measures nothing.
"""

from __future__ import annotations

import re
from typing import Any

from bench.report import md_table

PEERS = ("vllm-router", "sglang-router", "lmdeploy")


def aggregates(data: dict[str, Any]) -> list[dict[str, Any]]:
    from bench.quality_report import aggregate

    order = {f: i for i, f in enumerate(data["meta"]["families"])}
    return sorted(aggregate(data["rows"]), key=lambda a: (order.get(a["family"], 99), a["load"] != "closed",
                                                          a["load"], not a["route"].startswith("kvroute:default")))


def _cell(a: dict[str, Any], m: str, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
    """bench.quality's cell, mean (min-max), without a range whose ends round to the same figure."""
    from bench.quality_report import metric_cell as cell

    return re.sub(r" \(([^()]+)-\1\)$", "", cell(a, m, scale, digits, unit))


def quality_table(data: dict[str, Any], cold: bool = False) -> str:
    """Every (family, load, route) of a quality result: mean (min-max) over its repeats, as its markdown has it."""
    from bench.quality_report import load_name

    rows, last = [], None
    for a in aggregates(data):
        key = (a["family"], a["load"])
        head = [a["family"], load_name(a["load"])] if key != last else ["", ""]
        last = key
        rate = _cell(a, "makespan_s", digits=1) + " s" if a["load"] == "closed" else _cell(a, "req_per_s", digits=2)
        if cold:
            rows.append([*head, a["label"], _cell(a, "ttft_p99", 1000), _cell(a, "ttft_p99_seen", 1000),
                         _cell(a, "cold_in_slowest_1pct", digits=1)])
            continue
        rows.append([*head, a["label"], rate, _cell(a, "ttft_p50", 1000), _cell(a, "ttft_p99", 1000),
                     _cell(a, "ttft_p99_warm", 1000) if a["load"] == "closed" else "", _cell(a, "lat_p99", 1000),
                     _cell(a, "goodput_frac", 100, 0, "%"), _cell(a, "prefix_hit", 100, 0, "%"),
                     _cell(a, "preemptions"), _cell(a, "failed")])
    if cold:
        return md_table(["family", "load", "route", "TTFT p99 ms", "p99 without cold first uses ms",
                         "cold first uses in slowest 1%"], rows)
    return md_table(["family", "load", "route", "makespan (closed) / req/s", "TTFT p50 ms", "TTFT p99 ms",
                     "p99 after 1st wave ms", "end-to-end p99 ms", "goodput", "prefix hit", "preempt / 1000",
                     "failed"], rows)


def trace_table(data: dict[str, Any]) -> str:
    """A recorded trace's cells: each route's TTFT p50/p90/p99 and, for kvroute, its p90 and p99 over the best
    peer's (the peer with the lowest mean of that percentile among those that failed and refused nothing)."""
    from bench.quality_report import load_name, metric_mean

    aggs = aggregates(data)
    rows, last = [], None
    for a in aggs:
        key = (a["family"], a["load"])
        head = [a["family"], load_name(a["load"])] if key != last else ["", ""]
        last = key
        ratios = []
        for tail in ("ttft_p90", "ttft_p99"):
            best = best_peer([b for b in aggs if (b["family"], b["load"]) == key], tail, lowest=True)
            mine, theirs = metric_mean(a, tail), metric_mean(best, tail) if best else None
            ratios.append(f"{mine / theirs:.2f}x" if a["route"] == "kvroute:default" and mine and theirs else "")
        rows.append([*head, a["label"], _cell(a, "req_per_s", digits=2), _cell(a, "ttft_p50", 1000),
                     _cell(a, "ttft_p90", 1000), _cell(a, "ttft_p99", 1000), *ratios, _cell(a, "lat_p99", 1000),
                     _cell(a, "prefix_hit", 100, 1, "%"), _cell(a, "failed"), _cell(a, "engine_lag_s", digits=2)])
    return md_table(["family", "load", "route", "req/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
                     "p90 / best peer", "p99 / best peer", "end-to-end p99 ms", "prefix hit", "failed",
                     "engine lag s"], rows)


def quality_verdicts(data: dict[str, Any]) -> str:
    from bench.quality_report import verdicts

    return md_table(["family", "load", "verdict"], verdicts(aggregates(data)))


def quality_meta(data: dict[str, Any]) -> str:
    m = data["meta"]
    return (f"{m['environment']}; {m['requests']} requests per cell, {m['repeats']} repeats, mean (min-max); a fresh "
            f"fleet of {m['workers']} `{m['preset']}` sims per cell at time scale {m['time_scale']}; times in "
            f"simulated ms; goodput = TTFT <= {m['ttft_slo']:g} s.\n\n`{m['command']}`")


def overhead_cells(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, list[float | None]]]:
    """(workload, route) -> per-repeat CPU us/req, its ratio to vllm-router round_robin's, req/s, added p99."""
    from bench.overhead import REFERENCE_ROUTE, direct_baseline

    out: dict[tuple[str, str], dict[str, list[float | None]]] = {}
    for r in rows:
        if r["route"].startswith("direct"):
            continue
        same = [x for x in rows if x["workload"] == r["workload"] and x.get("repeat", 0) == r.get("repeat", 0)]
        ref = next((x["cpu_us_per_req"] for x in same if x["route"] == REFERENCE_ROUTE), None)
        base = direct_baseline(same) or {}
        c = out.setdefault((r["workload"], r["route"]), {"cpu": [], "ratio": [], "rps": [], "p99": []})
        c["cpu"].append(r["cpu_us_per_req"])
        c["ratio"].append(r["cpu_us_per_req"] / ref if ref and r["cpu_us_per_req"] else None)
        c["rps"].append(r["req_per_s"])
        c["p99"].append(r["lat_p99"] - base["lat_p99"] if "lat_p99" in base and r["lat_p99"] is not None else None)
    return out


def overhead_table(rows: list[dict[str, Any]]) -> str:
    from bench.overhead import REFERENCE_ROUTE, _span

    table, prev = [], None
    for (wl, route), c in overhead_cells(rows).items():
        table.append([wl if wl != prev else "", route, _span(c["cpu"]), _span(c["ratio"], digits=2), _span(c["rps"]),
                      _span(c["p99"], 1000, 1, True)])
        prev = wl
    return md_table(["workload", "route", "CPU us/req", f"CPU / {REFERENCE_ROUTE}", "req/s", "added p99 ms"], table)


def tree_table(rows: list[dict[str, Any]]) -> str:
    """An overhead run of two source trees (a route's `@tree=` knob): each route's CPU us/req, req/s and added p99,
    and the CPU of the tree under test over the other tree's in the same repeat."""
    from bench.overhead import _span

    table, prev = [], None
    for (wl, route), c in overhead_cells(rows).items():
        ratios: list[float | None] = []
        if "@tree=" not in route:
            for r in rows:
                if r["workload"] != wl or r["route"] != route:
                    continue
                other = next((x for x in rows if x["workload"] == wl and x.get("repeat", 0) == r.get("repeat", 0)
                              and "@tree=" in x["route"]), None)
                if other is not None and other["cpu_us_per_req"] and r["cpu_us_per_req"]:
                    ratios.append(r["cpu_us_per_req"] / other["cpu_us_per_req"])
        table.append([wl if wl != prev else "", route, _span(c["cpu"]), _span(ratios, digits=2), _span(c["rps"]),
                      _span(c["p99"], 1000, 1, True)])
        prev = wl
    return md_table(["workload", "route", "CPU us/req", "CPU / the other tree's", "req/s", "added p99 ms"], table)


def best_peer(cell: list[dict[str, Any]], metric: str, lowest: bool) -> dict[str, Any] | None:
    """The peer route with the best mean among those that failed and refused nothing."""
    from bench.quality_report import lost_share, metric_mean

    ok = [a for a in cell
          if a["route"].split(":")[0] in PEERS and not lost_share(a) and metric_mean(a, metric) is not None]
    return (min if lowest else max)(ok, key=lambda a: metric_mean(a, metric) or 0.0, default=None)
