"""A `kvroute bench disagg --sweep` run's tables, from its JSON: per family the sustained rate of each route.

Owns the sweep's formatting (bench/disagg_sweep.py owns its rules, bench/disagg_report.py the page around these
sections and the bars): per family a table of route | sustained rate (median, min-max over repeats) | ratio to
vllm-router | attainment at each multiplier, a table of each step's figures, and the issue's two bars on the
median sustained rates.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.disagg_report import bars, fmt, median_of, ratio
from bench.report import md_table


def sustained_by_route(data: dict[str, Any], family: str) -> dict[str, list[float]]:
    """Each route's sustained rates over its repeats, routes in the order they ran."""
    out: dict[str, list[float]] = {}
    for record in data.get("sustained", []):
        if record["family"] == family:
            out.setdefault(record["route"], []).append(record["sustained_rate"])
    return out


def steps_by_route(data: dict[str, Any], family: str) -> dict[str, dict[float, list[dict[str, Any]]]]:
    """route -> multiplier -> the step rows of every repeat that ran it."""
    out: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for row in data["rows"]:
        if row["family"] == family:
            out.setdefault(row["route"], {}).setdefault(row["multiplier"], []).append(row)
    return out


def baseline_of(route: str, medians: dict[str, float]) -> str | None:
    """The vllm-router route a route is compared with: the same shape for kvroute:SHAPE, else the best one."""
    theirs = {r: v for r, v in medians.items() if r.startswith("vllm-router:")}
    same_shape = "vllm-router:" + route.split(":", 1)[1] if route.startswith("kvroute:") else None
    if same_shape in theirs:
        return same_shape
    return max(theirs, key=lambda r: theirs[r]) if theirs else None


def _versus(route: str, medians: dict[str, float]) -> str:
    base = baseline_of(route, medians)
    if base is None:
        return "-"
    if medians[base] == 0 and medians[route] > 0:
        return f"{base} sustained none"  # it missed the SLO at the first step: no finite ratio
    r = ratio(medians[route], medians[base])
    return f"{'-' if r is None else f'{r:.2f}x'} {base}"


def _attainment(runs: list[dict[str, Any]] | None, repeats: int) -> str:
    if not runs:
        return "-"
    share = f"{100 * statistics.median(r['attainment'] for r in runs):.0f}%"
    return share if len(runs) >= repeats else f"{share} ({len(runs)}/{repeats})"


def sustained_table(data: dict[str, Any], family: str) -> str:
    sustained = sustained_by_route(data, family)
    steps = steps_by_route(data, family)
    medians = {route: statistics.median(rates) for route, rates in sustained.items()}
    multipliers = data["meta"]["sweep"]
    lines = []
    for route, rates in sustained.items():
        by_step = steps.get(route, {})
        repeats = len({r["repeat"] for runs in by_step.values() for r in runs})
        lag = max((r["engine_lag_s"] for runs in by_step.values() for r in runs), default=None)
        lines.append([route, f"{medians[route]:.2f} ({min(rates):.2f}-{max(rates):.2f})", _versus(route, medians),
                      *(_attainment(by_step.get(m), repeats) for m in multipliers), fmt(lag)])
    return md_table(("route", "sustained req/s", "vs vllm-router", *(f"x{m:g}" for m in multipliers),
                     "engine lag s (max)"), lines)


def steps_table(data: dict[str, Any], family: str) -> str:
    lines = []
    for route, by_step in steps_by_route(data, family).items():
        for multiplier in sorted(by_step):
            runs = by_step[multiplier]
            lines.append([route, f"x{multiplier:g}", f"{runs[0]['rate']:g}", len(runs),
                          f"{100 * (median_of(runs, 'attainment') or 0):.0f}%", fmt(median_of(runs, "ttft_p50")),
                          fmt(median_of(runs, "ttft_p99")), fmt(median_of(runs, "tpot_p99"), 1000, 0),
                          fmt(median_of(runs, "req_per_s")), fmt(median_of(runs, "kv_moved_gb"), 1, 1),
                          f"{100 * (median_of(runs, 'split_share') or 0):.0f}%", sum(r["failed"] for r in runs),
                          fmt(max(r["engine_lag_s"] for r in runs))])
    return md_table(("route", "step", "req/s offered", "runs", "attainment", "TTFT p50 s", "TTFT p99 s",
                     "TPOT p99 ms", "throughput req/s", "KV moved GB", "split", "failed", "engine lag s"), lines)


def sweep_sections(data: dict[str, Any]) -> list[str]:
    """The markdown sections after the page's intro: one per family, then the bars."""
    meta = data["meta"]
    parts: list[str] = []
    bar_lines: list[str] = []
    for family, note in meta["families"].items():
        sustained = sustained_by_route(data, family)
        if not sustained:
            continue
        rate = meta.get("rates", {}).get(family)
        parts += [f"## {family}", "", note + (f". Rate at x1: {rate:g} req/s." if rate else ""), "",
                  "Sustained rate:", "", sustained_table(data, family), "", "Each step (medians over the repeats "
                  "that ran it):", "", steps_table(data, family), ""]
        bar_lines += bars(family, {route: statistics.median(rates) for route, rates in sustained.items()},
                          "sustained")
    if bar_lines:
        parts += ["## The bars", "", *bar_lines, ""]
    return parts
