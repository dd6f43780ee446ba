"""Where a route's TTFT on a trace window exceeds the queue floor, request by request.

Owns the per-request comparison of a quality run's saved requests (`kvroute bench quality ... --save-requests FILE`)
with bench/ttft_floor.py's queue floor at the same arrival times: for each route, how far its requests' TTFTs lie
above the floor, by prompt length, and what its slowest tenth is made of (the requests the floor also finds slow, or
others). Nothing is sent; it reads the two files and the trace.

Run: python -m bench.floor_excess --result RESULT.json --requests FILE
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from backends.sim.presets import get_preset
from bench.loadgen import percentile
from bench.report import ms
from bench.traces import TRACE_DIR, TRACE_FAMILIES
from bench.ttft_floor import PRESET, cell_queue_floor, window_requests

LENGTHS = (4000, 8000, 16000)  # prompt-length buckets (tokens): up to each, and above the last


def _ms(values: Sequence[float], q: float) -> str:
    return ms(percentile(values, q), digits=0)


def _pairs(saved: Iterable[Mapping[str, Any]], floors: Sequence[float],
           lengths: Sequence[int]) -> list[tuple[float, float, int]]:
    """(TTFT, queue floor, prompt tokens) of each saved request with a first token, by its window index."""
    return [(d["ttft_s"], floors[d["index"]], lengths[d["index"]])
            for d in saved if d.get("ttft_s") is not None and 0 <= d["index"] < len(floors)]


def excess_rows(route: str, saved: Iterable[Mapping[str, Any]], floors: Sequence[float],
                lengths: Sequence[int]) -> list[str]:
    """Markdown rows for one route, by prompt length: its TTFTs (seconds, by window index) against the queue
    floor's."""
    pairs = _pairs(saved, floors, lengths)
    rows = []
    edges = (0, *LENGTHS, None)
    for lo, hi in zip(edges, edges[1:], strict=False):
        part = [(t, f) for t, f, n in pairs if n > lo and (hi is None or n <= hi)]
        if not part:
            continue
        over = [t - f for t, f in part]
        label = f"{lo // 1000}-{hi // 1000}k" if hi else f"over {lo // 1000}k"
        rows.append(f"| {route} | {label} | {len(part)} | {_ms([t for t, _ in part], 90)} | "
                    f"{_ms([f for _, f in part], 90)} | {_ms(over, 50)} | {_ms(over, 90)} |")
    return rows


def slowest_row(route: str, saved: Iterable[Mapping[str, Any]], floors: Sequence[float],
                lengths: Sequence[int]) -> str | None:
    """A markdown row: the route's slowest tenth of requests, their mean TTFT and queue floor, how many of them the
    floor also puts in its slowest tenth, and their mean prompt."""
    pairs = _pairs(saved, floors, lengths)
    if not pairs:
        return None
    slowest = sorted(pairs, key=lambda p: -p[0])[:max(1, len(pairs) // 10)]
    start = sorted(floors, reverse=True)[min(len(floors), len(slowest)) - 1]  # where the floor's slowest tenth begins
    k = len(slowest)
    return (f"| {route} | {k} | {sum(p[0] for p in slowest) / k * 1e3:.0f} | {sum(p[1] for p in slowest) / k * 1e3:.0f} "
            f"| {sum(p[1] >= start for p in slowest)} | {sum(p[2] for p in slowest) / k:.0f} |")


def report(result: Mapping[str, Any], saved: Sequence[Mapping[str, Any]], trace_dir: Path = TRACE_DIR) -> list[str]:
    """Markdown: per trace family of the saved requests, each route's excess by prompt length (excess_rows) and its
    slowest tenth (slowest_row), over all its cells."""
    preset = get_preset(PRESET)
    by_family: dict[str, dict[str, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for d in saved:
        by_family[d["family"]][d["route"]].append(d)
    lines: list[str] = []
    for family, routes in by_family.items():
        rows = [r for r in result["rows"] if r.get("family") == family and r.get("trace_speedup")]
        if family not in TRACE_FAMILIES or not rows:
            continue
        requests = window_requests(family, preset, rows[0]["trace_start_s"], rows[0]["trace_duration_s"], trace_dir)
        floors, _ = cell_queue_floor(result, rows, requests, preset)
        lengths = [r.input_length for r in requests]
        lines += [f"{family}: {len(requests)} requests, queue floor p50 / p90 / p99 {_ms(floors, 50)} / "
                  f"{_ms(floors, 90)} / {_ms(floors, 99)} ms\n",
                  "| route | prompt tokens | requests | TTFT p90 ms | queue floor p90 ms | TTFT - floor p50 ms | "
                  "TTFT - floor p90 ms |", "|---|---|---|---|---|---|---|"]
        for route, items in routes.items():
            lines += excess_rows(route, items, floors, lengths)
        lines += ["", "| route | its slowest tenth | mean TTFT ms | mean queue floor ms | also in the floor's slowest "
                  "tenth | mean prompt tokens |", "|---|---|---|---|---|---|"]
        lines += [row for route, items in routes.items() if (row := slowest_row(route, items, floors, lengths))]
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_excess", description=__doc__.split("\n")[0])
    parser.add_argument("--result", type=Path, required=True, help="the quality run's JSON")
    parser.add_argument("--requests", type=Path, required=True, help="its --save-requests file (JSON lines)")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    saved = [json.loads(line) for line in args.requests.read_text().splitlines() if line.strip()]
    print("\n".join(report(result, saved, args.trace_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
