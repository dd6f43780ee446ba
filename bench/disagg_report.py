"""The disaggregation benchmark's markdown, from its JSON: one table per workload family and the issue's two bars.

Owns formatting only (bench/disagg.py measures): each figure is the median of a route's repeats, goodput with its
range; the verdicts compare kvroute with vllm-router's PD mode on the same fleet shape, and kvroute's conditional
disaggregation with the better of the aggregated fleet and the best fixed split.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.report import md_table

COLUMNS = ("TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "TPOT p99 ms", "goodput req/s",
           "throughput req/s", "out tok/s", "KV moved GB", "split", "failed", "engine lag s")


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def by_route(data: dict[str, Any], family: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in data["rows"]:
        if row["family"] == family:
            out.setdefault(row["route"], []).append(row)
    return out


def goodput(rows: list[dict[str, Any]]) -> float:
    return _median(rows, "goodput_per_s") or 0.0


def family_table(routes: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for route, rows in routes.items():
        g = [r["goodput_per_s"] for r in rows]
        lines.append([route, _fmt(_median(rows, "ttft_p50")), _fmt(_median(rows, "ttft_p99")),
                      _fmt(_median(rows, "itl_p50"), 1000, 0), _fmt(_median(rows, "itl_p99"), 1000, 0),
                      _fmt(_median(rows, "tpot_p99"), 1000, 0),
                      f"{goodput(rows):.2f} ({min(g):.2f}-{max(g):.2f})", _fmt(_median(rows, "req_per_s")),
                      _fmt(_median(rows, "output_tok_per_s"), 1, 0), _fmt(_median(rows, "kv_moved_gb"), 1, 1),
                      f"{100 * (_median(rows, 'split_share') or 0):.0f}%", sum(r["failed"] for r in rows),
                      _fmt(max(r["engine_lag_s"] for r in rows))])
    return md_table(("route", *COLUMNS), lines)


def verdicts(data: dict[str, Any]) -> list[str]:
    out = []
    for family in data["meta"]["families"]:
        routes = by_route(data, family)
        for route, rows in routes.items():
            if not route.startswith("vllm-router:"):
                continue
            shape = route.split(":", 1)[1]
            ours = routes.get(f"kvroute:{shape}")
            if ours:
                ratio = goodput(ours) / goodput(rows) if goodput(rows) else float("inf")
                out.append(f"- {family}, {shape}: kvroute (conditional) {goodput(ours):.2f} req/s of goodput vs "
                           f"vllm-router PD {goodput(rows):.2f}: {ratio:.2f}x (bar: 1.2x) "
                           f"{'PASS' if ratio >= 1.2 else 'FAIL'}")
        conditional = {r: rows for r, rows in routes.items() if r.startswith("kvroute:")}
        fixed = {r: rows for r, rows in routes.items() if r.startswith("kvroute-split:") or r == "aggregated"}
        if conditional and fixed:
            best_c = max(conditional, key=lambda r: goodput(conditional[r]))
            best_f = max(fixed, key=lambda r: goodput(fixed[r]))
            ok = goodput(conditional[best_c]) >= goodput(fixed[best_f])
            out.append(f"- {family}: best conditional ({best_c}) {goodput(conditional[best_c]):.2f} req/s vs the "
                       f"best of aggregated and fixed splits ({best_f}) {goodput(fixed[best_f]):.2f}: "
                       f"{'PASS' if ok else 'FAIL'}{' (the bar is for mixed_images)' if family != 'mixed_images' else ''}")
    return out


def render(data: dict[str, Any]) -> str:
    meta = data["meta"]
    parts = [f"# Disaggregated serving: {meta['workers']} x {meta['preset']} sims, kvroute vs fixed splits vs "
             f"vllm-router's PD mode", "",
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
    if data.get("failed_cells"):
        parts += ["## Cells that failed", "", *(f"- {c}" for c in data["failed_cells"]), ""]
    return "\n".join(parts)
