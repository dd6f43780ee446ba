"""The README "Performance" headline: kvroute against the best peer, from the latest result JSON files.

Owns only the selection and the markdown; `python -m bench.headline [RESULTS_DIR]` prints it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.report import RESULTS_DIR, fmt, md_table, ms

PEERS = ("vllm-router", "sglang-router", "lmdeploy")


def _latest(directory: Path, name: str) -> list[dict[str, Any]] | None:
    files = sorted(directory.glob(f"*-{name}.json"))
    return json.loads(files[-1].read_text()) if files else None


def _is_peer(route: str) -> bool:
    return route.split(":", 1)[0] in PEERS


def overhead_rows(rows: list[dict[str, Any]], workload: str = "stream") -> list[list[str]]:
    from bench.overhead import direct_baseline

    cell = [r for r in rows if r["workload"] == workload]
    direct = direct_baseline(cell)
    if not direct:
        return []

    def line(r: dict[str, Any], label: str) -> list[str]:
        return [label, r["route"], fmt(r["req_per_s"], digits=0), ms(r["lat_p50"] - direct["lat_p50"], True),
                ms(r["lat_p99"] - direct["lat_p99"], True), fmt(r["cpu_us_per_req"], digits=0),
                fmt(r["rss_mb"], digits=0), f"{r['failed']}/{r['rejected']}"]

    out = []
    kv = next((r for r in cell if r["route"] == "kvroute:kv_aware"), None)
    if kv:
        out.append(line(kv, "kvroute (default kv_aware)"))
    peers = [r for r in cell if _is_peer(r["route"]) and r["cpu_us_per_req"]]
    if peers:
        out.append(line(min(peers, key=lambda r: r["cpu_us_per_req"]), "peer with least CPU"))
        out.append(line(min(peers, key=lambda r: r["lat_p99"]), "peer with least added p99"))
    return out


def quality_rows(rows: list[dict[str, Any]], loads: tuple[float, ...] = (0.8, 0.95)) -> list[list[str]]:
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for load in loads:
            cell = [r for r in rows if r["kind"] == kind and abs(r["load"] - load) < 1e-9]
            kv = next((r for r in cell if r["route"] == "kvroute:kv_aware"), None)
            peers = [r for r in cell if _is_peer(r["route"])]
            if not kv or not peers:
                continue
            # best peer: most goodput, then lowest TTFT p99
            best = max(peers, key=lambda r: (r["goodput_frac"], -(r["ttft_p99"] or 1e9)))
            best_kv = max((r for r in cell if r["route"].startswith("kvroute:")),
                          key=lambda r: (r["goodput_frac"], -(r["ttft_p99"] or 1e9)))
            out.append([kind, f"{int(load * 100)}%", ms(kv["ttft_p99"], digits=0),
                        fmt(100 * kv["goodput_frac"], "%", 0), f"{kv['failed']}/{kv['rejected']}",
                        best["route"], ms(best["ttft_p99"], digits=0), fmt(100 * best["goodput_frac"], "%", 0),
                        f"{best['failed']}/{best['rejected']}",
                        f"{best_kv['route'].split(':', 1)[1]} ({ms(best_kv['ttft_p99'], digits=0)} ms, "
                        f"{100 * best_kv['goodput_frac']:.0f}%)"])
    return out


def render(directory: Path = RESULTS_DIR) -> str:
    parts = []
    over = _latest(directory, "overhead")
    if over:
        parts.append("Overhead (2000 streaming requests, concurrency 64, 16 tokens; 4 sim workers; "
                     "added latency over direct calls in the same run):\n")
        parts.append(md_table(["", "route", "req/s", "added p50 ms", "added p99 ms", "CPU us/req", "RSS MB",
                               "failed/rejected"], overhead_rows(over)))
    qual = _latest(directory, "quality")
    if qual:
        parts.append("\nRouting quality (TTFT in simulated ms; goodput = TTFT <= 1 s; best peer = most goodput):\n")
        parts.append(md_table(["workload", "load", "kv_aware TTFT p99", "kv_aware goodput", "kv_aware fail/rej",
                               "best peer", "peer TTFT p99", "peer goodput", "peer fail/rej",
                               "best kvroute policy"], quality_rows(qual)))
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS_DIR))
