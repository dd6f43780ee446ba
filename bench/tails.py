"""What a quality cell's TTFT tail is made of, from its per-request results.

Owns three views of one run: the closed loop's tail after its first wave (every client's first request onto
the cold fleet at once), the cold first uses of shared prefixes (requests that must prefill a system prompt or
image no earlier request presented, whatever the route), and the per-request records `--save-requests` writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.loadgen import RunResult, percentile
from bench.workloads import Workload


def save_requests(path: Path, w: Workload, route: str, load: str, salt: str, run: RunResult) -> None:
    """Append one JSON line per request of this cell (times in simulated seconds), to see who makes a tail."""
    with path.open("a") as f:
        for r in run.results:
            f.write(json.dumps({"family": w.kind, "route": route, "load": load, "cell": salt, "index": r.index,
                                "tag": r.tag, "worker": r.worker, "status": r.status, "sent_at": r.sent_at,
                                "ttft_s": r.ttft_s, "latency_s": r.latency_s}) + "\n")


def cold_start(w: Workload, run: RunResult) -> dict[str, Any]:
    """The cell's cold first uses: requests that were the first (in send order) to present their shared prefix
    (system prompt, or system prompt + image; every cell salts them, so each starts cold). Each must prefill
    that prefix wherever it goes, so no route can make them fast. Returns their count, how many of them are
    among the slowest 1% of TTFTs (the ones p99 is made of), and the TTFT p99 of the other requests."""
    seen: set[Any] = set()
    cold: set[int] = set()
    for r in sorted(run.results, key=lambda r: r.sent_at):
        key = w.shared_prefix_key(r.index)
        if key is not None and key not in seen:
            seen.add(key)
            cold.add(r.index)
    timed = sorted((r for r in run.results if r.ok and r.ttft_s is not None), key=lambda r: -r.ttft_s)
    slowest = timed[:max(1, len(timed) // 100)] if timed else []
    return {"cold_first_uses": len(cold), "cold_in_slowest_1pct": sum(r.index in cold for r in slowest),
            "ttft_p99_seen": percentile([r.ttft_s for r in timed if r.index not in cold], 99)}


def ttft_p99_after_first_wave(run: RunResult) -> float | None:
    """TTFT p99 of a closed loop without its first wave: the requests sent before any response had
    finished (every client's first request, onto a cold fleet at once). In a 1000-request cell that wave
    is ~13% of the requests, so the whole cell's p99 is the cold start's; this is the loop's steady tail."""
    first_done = min((r.sent_at + r.latency_s for r in run.results if r.ok), default=None)
    if first_done is None:
        return None
    return percentile([r.ttft_s for r in run.results if r.ok and r.ttft_s is not None and r.sent_at > first_done], 99)
