"""How much of a trace window's prompts any router could find cached: the prefix-hit ceiling with unbounded caches
and with the fleet's KV, beside what placement rules reach on the same caches.

Owns that replay; nothing is sent (routers and engines are not involved). The requests of a window are taken in
arrival order, each a run of 512-token blocks named by the trace's hash ids (bench/traces.py renders each as that
many engine tokens, so the engines' blocks line up with them). A request's hit is its leading blocks the chosen
cache holds (at most its prompt less one token: the engine computes the last), in tokens, over its prompt tokens:

- unbounded: one cache that forgets nothing; no fleet finds more (the window's own reuse).
- pooled: one least-recently-used cache of workers x KV per worker tokens: the fleet's KV with no prefix held twice.
- sticky: one LRU cache of KV per worker on each worker; a request goes to the worker holding its longest leading
  match when that is more than half its blocks (sglang-router cache_aware's threshold; ties: fewest tokens
  prefilled there so far), else to the one that prefilled the fewest.
- balanced: the same caches, every request to the worker that prefilled the fewest tokens (placement by load only).

A request's blocks enter its cache tail first, as vLLM frees a finished request's blocks (so its tail is evicted
first). The caches here hold every block a request presented until it is the least recently used, where an engine's cache
also holds its running requests' KV (it keeps less) but counts hits in 16-token blocks (a partly presented 512-token
block hits in part): a model, not a strict bound, and measured rates land near it (conversation 600-900 s: pooled
9.7%, sglang-router measured 10.5%). What the figures say is where the limit lies: far below `unbounded` even for `pooled`
means the window reuses more than the fleet can keep, and a router gains hits there only by holding fewer copies of
a prefix (sticky against balanced), not by finding them.

Run: python -m bench.trace_hit_bound --result bench/results/<quality>.json [--families trace_synthetic]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.traces import (
    BLOCK_TOKENS,
    TRACE_DIR,
    TRACE_FAMILIES,
    BlockVocabulary,
    TraceRequest,
    load_window,
    trace_path,
)


class BlockCache:
    """One least-recently-used cache of 512-token blocks named by the trace's hash ids (None: unbounded)."""

    def __init__(self, blocks: int | None = None) -> None:
        self.blocks = blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def leading(self, hash_ids: Sequence[int]) -> int:
        """How many of a request's leading blocks the cache holds."""
        n = 0
        for h in hash_ids:
            if h not in self._lru:
                break
            n += 1
        return n

    def present(self, hash_ids: Sequence[int]) -> None:
        """A request's blocks enter (or refresh in) the cache, tail first, as vLLM frees a request's blocks (so its
        tail is evicted first); the least recently used leave beyond the cache's size."""
        lru = self._lru
        for h in reversed(hash_ids):
            lru[h] = None
            lru.move_to_end(h)
        if self.blocks is not None:
            while len(lru) > self.blocks:
                lru.popitem(last=False)


@dataclass
class Fleet:
    """What a placement rule sees for one request: per worker, the request's leading blocks its cache holds, the
    tokens it prefilled so far, and those it prefilled in the last `recent_s` trace seconds (its load now)."""

    matches: list[int]
    prefilled: list[int]
    recent: list[int]
    blocks: int  # the request's

    def holder(self) -> int:
        """The worker holding the longest leading match (ties: fewest tokens prefilled there so far)."""
        return min(range(len(self.matches)), key=lambda i: (-self.matches[i], self.prefilled[i]))

    def holds_most(self, worker: int) -> bool:
        """Whether `worker` holds more than half the request's blocks (sglang-router cache_aware's threshold)."""
        return self.matches[worker] * 2 > self.blocks


Chooser = Callable[[Fleet], int]


def following(otherwise: Chooser) -> Chooser:
    """A rule that sends a request to the worker holding more than half its blocks, else where `otherwise` says."""
    def choose(fleet: Fleet) -> int:
        best = fleet.holder()
        return best if fleet.holds_most(best) else otherwise(fleet)

    return choose


def sticky(fleet: Fleet) -> int:
    return following(balanced)(fleet)


def balanced(fleet: Fleet) -> int:
    return min(range(len(fleet.prefilled)), key=lambda i: fleet.prefilled[i])


def replay(requests: Sequence[TraceRequest], workers: int, blocks_per_worker: int | None,
           choose: Chooser = sticky, recent_s: float = 10.0) -> tuple[float, int]:
    """(share of the requests' prompt tokens found cached, requests sent away from a worker holding more than half
    their blocks) under `choose`, as the module docstring says; blocks_per_worker None: unbounded caches."""
    caches = [BlockCache(blocks_per_worker) for _ in range(workers)]
    prefilled = [0] * workers
    recent: list[deque[tuple[float, int]]] = [deque() for _ in range(workers)]
    load = [0] * workers
    hit = total = left = 0
    for req in requests:
        matches = [cache.leading(req.hash_ids) for cache in caches]
        for w, done in enumerate(recent):
            while done and done[0][0] <= req.t_s - recent_s:
                load[w] -= done.popleft()[1]
        fleet = Fleet(matches, prefilled, load, len(req.hash_ids))
        w = choose(fleet) if workers > 1 else 0
        if workers > 1 and fleet.holds_most(fleet.holder()) and not fleet.holds_most(w):
            left += 1
        found = min(matches[w] * BLOCK_TOKENS, req.input_length - 1)
        hit += found
        total += req.input_length
        prefilled[w] += req.input_length - found
        recent[w].append((req.t_s, req.input_length - found))
        load[w] += req.input_length - found
        caches[w].present(req.hash_ids)
    return (hit / total if total else 0.0), left


def replay_hit(requests: Sequence[TraceRequest], workers: int, blocks_per_worker: int | None,
               choose: Chooser = sticky) -> float:
    """Share of the requests' prompt tokens found cached (module docstring); blocks_per_worker None: unbounded."""
    return replay(requests, workers, blocks_per_worker, choose)[0]


def bounds(requests: Sequence[TraceRequest], workers: int, kv_tokens_per_worker: int) -> dict[str, float]:
    """The four figures of the module docstring for one window."""
    per_worker = kv_tokens_per_worker // BLOCK_TOKENS
    return {"unbounded": replay_hit(requests, 1, None),
            "pooled": replay_hit(requests, 1, per_worker * workers),
            "sticky": replay_hit(requests, workers, per_worker, sticky),
            "balanced": replay_hit(requests, workers, per_worker, balanced)}


def _load(load: Any) -> str:
    try:
        return f"{float(load):.0%}"
    except ValueError:
        return str(load)


def _measured(result: dict[str, Any], family: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in result.get("rows", []):
        if row.get("family") == family and row.get("prefix_hit") is not None:
            out.setdefault(f"{row['route']} at {_load(row['load'])}", []).append(row["prefix_hit"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace_hit_bound", description=__doc__.split("\n")[0])
    parser.add_argument("--result", type=Path, required=True, help="a `kvroute bench quality` JSON with trace cells")
    parser.add_argument("--families", default=",".join(TRACE_FAMILIES))
    parser.add_argument("--workers", type=int, default=4, help="when the result does not say")
    parser.add_argument("--kv-tokens", type=int, default=342068, help="KV per worker, when the result does not say")
    parser.add_argument("--max-context", type=int, default=32768, help="the preset's max_model_len")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    families = result.get("meta", {}).get("families", {})
    workers = int(result.get("meta", {}).get("workers", args.workers))
    print("# Prefix-hit ceiling of trace windows\n")
    print("Command: `python -m bench.trace_hit_bound" + "".join(f" {a}" for a in (argv if argv is not None
          else sys.argv[1:])) + "`. How it is computed: the module docstring of bench/trace_hit_bound.py.\n")
    print("| family | window s | requests | KV per worker | unbounded | pooled | sticky | balanced | measured (mean, min-max) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        rows = [r for r in result.get("rows", []) if r.get("family") == family]
        if not rows:
            continue
        start, duration = float(rows[0]["trace_start_s"]), float(rows[0]["trace_duration_s"])
        kv_tokens = int(families.get(family, {}).get("kv_tokens", args.kv_tokens))
        reqs = load_window(family, trace_path(family, args.trace_dir), start, duration, args.max_context, kv_tokens,
                           "", BlockVocabulary()).requests  # the requests a quality run replays for that window
        b = bounds(reqs, workers, kv_tokens)
        measured = "; ".join(f"{label} {sum(v) / len(v):.1%} ({min(v):.1%}-{max(v):.1%})"
                             for label, v in _measured(result, family).items())
        print(f"| {family} | {start:.0f}-{start + duration:.0f} | {len(reqs)} | {kv_tokens} | {b['unbounded']:.1%} | "
              f"{b['pooled']:.1%} | {b['sticky']:.1%} | {b['balanced']:.1%} | {measured} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
