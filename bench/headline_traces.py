"""Which recorded-trace runs (Mooncake FAST'25 windows) docs/performance.md and the README show, and the README's
trace summary (bench/headline.py lays them out).

Owns the list of trace runs, what each one's title says of it, and the summary of kvroute against the best peer per
trace, window and load; it reads files only through the loader it is given and measures nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.headline_tables import aggregates, best_peer
from bench.report import md_table

TRACE_LONG = "2026-12-05-quality-traces-300s-95-per-step-3"  # 300-s windows at 95% load: the README's last column
LONG_RUNS = ("2026-12-05-quality-traces-300s-50", "2026-12-05-quality-traces-300s-80-per-step-3",
             TRACE_LONG)  # the README's 300-s columns, in order
STEP_1 = "2026-12-05-quality-traces-300s-95-bonus"  # the same at prefix_bonus_per_step 1, the default before c49b07f
BEFORE_BONUS = ("2026-12-04-quality-traces-30s-simcache", "2026-12-04-quality-traces-300s-95")
OTHER_WINDOW = "2026-12-05-quality-traces-300s-80-from-300"  # a window (300-600 s) no default was tuned on
TRACE_RUNS = ("2026-12-05-quality-traces-30s-per-step-3", *LONG_RUNS, OTHER_WINDOW,
              "2026-12-05-quality-traces-30s-bonus", STEP_1,
              *BEFORE_BONUS,
              "2026-12-04-quality-traces-30s-evict",
              "2026-12-04-quality-trace-conversation-60s",
              "2026-12-04-quality-traces-oracle")  # recorded traces, kvroute against every peer
BEFORE_SIM_CACHE = " (on the sim before it cached a block when its step is scheduled: design/sim.md)"
TRACE_NOTES = {  # what a title says of a run
    TRACE_RUNS[0]: " (30-s windows at 50/80/95% load)",
    LONG_RUNS[0]: " (300-s windows at 50% load, against sglang-router `cache_aware` and vllm-router's KV-event policy)",
    LONG_RUNS[1]: " (300-s windows at 80% load, against sglang-router `cache_aware` and vllm-router's KV-event policy)",
    OTHER_WINDOW: " (300-s windows from 300 s at 80% load, a window no default was tuned on, against sglang-router "
                  "`cache_aware` and vllm-router's KV-event policy)",
    "2026-12-05-quality-traces-30s-bonus": " (30-s windows at 50/80/95% load; `prefix_bonus_per_step` 1, the default "
                                           "before c49b07f)",
    TRACE_LONG: " (300-s windows at 95% load, against sglang-router `cache_aware` and vllm-router's KV-event policy, "
                "with kvroute at `prefix_bonus_per_step` 1 beside the default)",
    STEP_1: " (300-s windows at 95% load; `prefix_bonus_per_step` 1, the default before c49b07f)",
    BEFORE_BONUS[0]: " (before `prefix_bonus_per_step` was 1 by default)",
    BEFORE_BONUS[1]: " (300-s windows at 95% load, against sglang-router and vllm-router `cache_aware`; before "
                     "`prefix_bonus_per_step` was 1 by default)",
    "2026-12-04-quality-traces-30s-evict": BEFORE_SIM_CACHE,
    "2026-12-04-quality-trace-conversation-60s": " (at 4d1ccd2, whose block-aligned guess for a prompt just sent "
                                                 "was backed out after this run: docs/design/kv_aware.md; on the "
                                                 "sim before it cached a block when its step is scheduled)",
    "2026-12-04-quality-traces-oracle": " (with the oracle, which routes each request to its least predicted TTFT "
                                        "on the sims' true state: bench/oracle.py; floors: "
                                        "bench/results/2026-12-04-ttft-floor-traces.md; on the sim before it "
                                        "cached a block when its step is scheduled)",
}


def trace_title(stem: str) -> str:
    """The title of a trace run's section in docs/performance.md."""
    return "Recorded traces: " + stem.split("quality-")[-1] + TRACE_NOTES.get(stem, "")


def trace_summary(load: Callable[[str], Any]) -> str:
    """Per recorded trace and load: kvroute's TTFT p90 and p99 over the best peer's (lowest mean of that
    percentile), and its engines' prefix hit rate beside the best peer's."""
    from bench.quality_report import load_name, metric_mean

    stem = TRACE_RUNS[0]  # the run at the shipped code, then the 300-s windows
    aggs = aggregates(load(stem))
    loads = list(dict.fromkeys(a["load"] for a in aggs))
    columns = [(stem, aggs, load) for load in loads]
    for long_stem in LONG_RUNS:
        long = aggregates(load(long_stem))
        columns += [(long_stem, long, load) for load in dict.fromkeys(a["load"] for a in long)]
    rows = []
    for family in dict.fromkeys(a["family"] for a in aggs):
        row = [family.removeprefix("trace_")]
        for stem, run, load in columns:
            cell = [a for a in run if (a["family"], a["load"]) == (family, load)]
            mine = next((a for a in cell if a["route"] == "kvroute:default"), None)
            ratios = []
            for tail in ("ttft_p90", "ttft_p99"):
                best = best_peer(cell, tail, lowest=True)
                ours, theirs = metric_mean(mine, tail) if mine else None, metric_mean(best, tail) if best else None
                ratios.append(f"{ours / theirs:.2f}x" if ours and theirs else "-")
            best_hit = best_peer(cell, "prefix_hit", lowest=False)
            hit = (f"{100 * (metric_mean(mine, 'prefix_hit') or 0):.1f} vs "
                   f"{100 * (metric_mean(best_hit, 'prefix_hit') or 0):.1f}%") if mine and best_hit else "-"
            row.append(f"[{' / '.join(ratios)}, hit {hit}](bench/results/{stem}.md)")
        rows.append(row)
    return md_table(["trace", *(f"{load_name(load)} load{', 300-s window' if stem in LONG_RUNS else ''}: TTFT p90 / "
                                f"p99 over the best peer's, prefix hit" for stem, _, load in columns)], rows)
