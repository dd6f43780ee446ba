"""The disaggregation benchmark's markdown, from its JSON: one table per workload family and the issue's two bars.

Owns formatting only (bench/disagg.py measures): each figure is the median of a route's repeats, goodput with its
range; the verdicts compare kvroute with vllm-router's PD mode on the same fleet shape, and kvroute's conditional
disaggregation with the better of the aggregated fleet and the best fixed split. A --sweep run's tables (sustained
rate, attainment per step) are disagg_sweep_report.py's; the bars are the same, on the sustained rates.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.report import md_table

COLUMNS = ("TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "TPOT p99 ms", "goodput req/s",
           "throughput req/s", "out tok/s", "KV moved GB", "split", "failed", "engine lag s")


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def by_route(data: dict[str, Any], family: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in data["rows"]:
        if row["family"] == family:
            out.setdefault(row["route"], []).append(row)
    return out


def goodput(rows: list[dict[str, Any]]) -> float:
    return median_of(rows, "goodput_per_s") or 0.0


def family_table(routes: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for route, rows in routes.items():
        g = [r["goodput_per_s"] for r in rows]
        lines.append([route, fmt(median_of(rows, "ttft_p50")), fmt(median_of(rows, "ttft_p99")),
                      fmt(median_of(rows, "itl_p50"), 1000, 0), fmt(median_of(rows, "itl_p99"), 1000, 0),
                      fmt(median_of(rows, "tpot_p99"), 1000, 0),
                      f"{goodput(rows):.2f} ({min(g):.2f}-{max(g):.2f})", fmt(median_of(rows, "req_per_s")),
                      fmt(median_of(rows, "output_tok_per_s"), 1, 0), fmt(median_of(rows, "kv_moved_gb"), 1, 1),
                      f"{100 * (median_of(rows, 'split_share') or 0):.0f}%", sum(r["failed"] for r in rows),
                      fmt(max(r["engine_lag_s"] for r in rows))])
    return md_table(("route", *COLUMNS), lines)


def verdicts(data: dict[str, Any]) -> list[str]:
    out = []
    for family in data["meta"]["families"]:
        out += bars(family, {route: goodput(rows) for route, rows in by_route(data, family).items()}, "of goodput")
    return out


def ratio(ours: float, theirs: float) -> float | None:
    """ours / theirs; inf when only theirs is 0, None when both are."""
    if theirs:
        return ours / theirs
    return float("inf") if ours else None


def bars(family: str, scores: dict[str, float], what: str) -> list[str]:
    """The issue's two bars on one family's goodput by route (`what` says which goodput): kvroute >= 1.2x
    vllm-router's PD mode at the same shape; the best conditional route >= the best of aggregated and fixed splits."""
    out = []
    for route, theirs in scores.items():
        shape = route.split(":", 1)[1] if route.startswith("vllm-router:") else None
        if shape is None or f"kvroute:{shape}" not in scores:
            continue
        ours = scores[f"kvroute:{shape}"]
        r = ratio(ours, theirs)
        shown = "-" if r is None else "vllm-router none" if r == float("inf") else f"{r:.2f}x"
        out.append(f"- {family}, {shape}: kvroute (conditional) {ours:.2f} req/s {what} vs vllm-router PD "
                   f"{theirs:.2f}: {shown} (bar: 1.2x) {'PASS' if r is not None and r >= 1.2 else 'FAIL'}")
    conditional = {r: v for r, v in scores.items() if r.startswith("kvroute:")}
    fixed = {r: v for r, v in scores.items() if r.startswith("kvroute-split:") or r == "aggregated"}
    if conditional and fixed:
        best_c = max(conditional, key=lambda r: conditional[r])
        best_f = max(fixed, key=lambda r: fixed[r])
        ok = conditional[best_c] >= fixed[best_f]
        out.append(f"- {family}: best conditional ({best_c}) {conditional[best_c]:.2f} req/s vs the "
                   f"best of aggregated and fixed splits ({best_f}) {fixed[best_f]:.2f}: "
                   f"{'PASS' if ok else 'FAIL'}{' (the bar is for mixed_images)' if family != 'mixed_images' else ''}")
    return out


def render(data: dict[str, Any]) -> str:
    if data["meta"].get("sweep"):
        return render_sweep(data)
    meta = data["meta"]
    parts = [_title(meta), "",
             f"`{meta['command']}` ({meta['environment']}; {meta['repeats']} repeats, {meta['requests']} requests "
             f"per cell, time scale {meta['time_scale']}, link {meta['link']}, {meta['took_s'] / 60:.0f} min). "
             f"Simulated seconds. Goodput: the offered rate x the share of requests with TTFT <= "
             f"{meta['ttft_slo']:g} s and mean inter-token latency (TPOT) <= {1000 * meta['itl_slo']:.0f} ms. ITL: every gap between two tokens of "
             f"a stream. Each figure is the median of the repeats (goodput: median (min-max)); split: the share of "
             f"requests that went through a prefill worker; engine lag: the most any sim fell behind the wall "
             f"clock in a cell (0: the host kept up).", ""]
    for family, note in meta["families"].items():
        routes = by_route(data, family)
        if not routes:
            continue
        parts += [f"## {family}", "", note, "", family_table(routes), ""]
    verdict = verdicts(data)
    if verdict:
        parts += ["## The bars", "", *verdict, ""]
    return "\n".join(parts + _failed(data))


def _title(meta: dict[str, Any]) -> str:
    return (f"# Disaggregated serving: {meta['workers']} x {meta['preset']} sims, kvroute vs fixed splits vs "
            f"vllm-router's PD mode")


def _failed(data: dict[str, Any]) -> list[str]:
    if not data.get("failed_cells"):
        return []
    return ["## Cells that failed", "", *(f"- {c}" for c in data["failed_cells"]), ""]


def render_sweep(data: dict[str, Any]) -> str:
    """A --sweep run: per family the sustained rate of each route and its attainment at each step, then the
    steps' figures, then the bars on the sustained rates."""
    from bench.disagg_sweep_report import sweep_sections  # here: that module builds on this one's helpers

    meta = data["meta"]
    multipliers = ", ".join(f"{m:g}" for m in meta["sweep"])
    parts = [_title(meta) + ": goodput as the highest sustainable rate", "",
             f"`{meta['command']}` ({meta['environment']}; {meta['repeats']} repeats, {meta['requests']} requests "
             f"per step, time scale {meta['time_scale']}, link {meta['link']}, {meta['took_s'] / 60:.0f} min). "
             f"Simulated seconds. Goodput (DistServe's): the highest offered rate at which at least "
             f"{100 * meta['attainment']:.0f}% of requests meet TTFT <= {meta['ttft_slo']:g} s and mean inter-token "
             f"latency (TPOT) <= {1000 * meta['itl_slo']:.0f} ms. Per family, route and repeat one fleet and router "
             f"ran the family's rate times {multipliers} in that order, each step's prompts new to every cache and the "
             f"fleet idle before it, and stopped after the first step below the target; the sustained rate is the "
             f"last passing step's rate before it (0: the first step failed). Sustained: median (min-max) over the "
             f"repeats. vs vllm-router: kvroute:SHAPE against vllm-router:SHAPE, every other route against the "
             f"best vllm-router route. Attainment: the median over the repeats that ran the step ((k/n) when only k "
             f"of n did: the others had stopped).", ""]
    parts += sweep_sections(data)
    return "\n".join(parts + _failed(data))
