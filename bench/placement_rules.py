"""What placement rules reach on a trace window's caches, in bench/trace_hit_bound.py's model: where a prompt that
matches nothing goes, and what leaving the worker that holds a request's history costs.

Owns the rules and their table; the replay (LRU caches of the fleet's KV per worker, blocks named by the trace's hash
ids, nothing sent) is trace_hit_bound.replay's. Every rule but `balanced` follows a prompt to the worker holding more
than half its blocks (sglang-router cache_aware's threshold), and differs in one thing:

- matches nothing -> the worker that prefilled the fewest tokens so far (sglang-router's smallest approximate tree);
- matches nothing -> the worker that prefilled the fewest in the last `--recent-s` trace seconds (the least loaded
  now, as kv_aware sends it);
- matches nothing -> a random worker (mean of 3 seeds);
- leaves the holder for the least loaded worker when the holder prefilled N more tokens in the last `--recent-s`
  seconds (a load-driven move, of the kind kv_aware makes when a holder's queue outweighs its prefix bonus).

The model has no running requests' KV and no time: it says which rule keeps more of the window's reuse, not what
an engine measures (trace_hit_bound's docstring).

Run: python -m bench.placement_rules [--families trace_synthetic] [--recent-s 10]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.trace_hit_bound import Chooser, Fleet, balanced, following, replay, sticky
from bench.traces import (
    BLOCK_TOKENS,
    TRACE_DIR,
    TRACE_FAMILIES,
    BlockVocabulary,
    TraceRequest,
    load_window,
    trace_path,
)


def _least_loaded(fleet: Fleet) -> int:
    return min(range(len(fleet.recent)), key=lambda i: (fleet.recent[i], fleet.prefilled[i]))


def _cold_to_random(seed: int) -> Chooser:
    rng = random.Random(seed)
    return following(lambda fleet: rng.randrange(len(fleet.matches)))


def leaving_above(tokens: int) -> Chooser:
    def choose(fleet: Fleet) -> int:
        best, least = fleet.holder(), _least_loaded(fleet)
        if fleet.holds_most(best) and fleet.recent[best] - fleet.recent[least] <= tokens:
            return best
        return least

    return choose


def rules() -> list[tuple[str, Callable[[int], Chooser]]]:
    """(name, seed -> chooser) of each rule of the module docstring, in the table's order."""
    out: list[tuple[str, Callable[[int], Chooser]]] = [
        ("matches nothing: fewest tokens prefilled so far (sglang-router)", lambda _: sticky),
        ("matches nothing: least loaded now", lambda _: following(_least_loaded)),
        ("matches nothing: random", _cold_to_random)]
    for n in (100_000, 50_000, 20_000, 10_000):
        out.append((f"matches nothing: least loaded now; leaves the holder {n // 1000}k tokens busier",
                    lambda _, n=n: leaving_above(n)))
    out.append(("balanced (least prefilled so far, every request)", lambda _: balanced))
    return out


def table(family: str, requests: Sequence[TraceRequest], workers: int, kv_tokens: int, recent_s: float) -> list[str]:
    """Markdown rows, one per rule: the window's prefix hit and the holders left (mean over seeds for random)."""
    rows = []
    for name, make in rules():
        seeds = range(3) if "random" in name else range(1)
        runs = [replay(requests, workers, kv_tokens // BLOCK_TOKENS, make(seed), recent_s) for seed in seeds]
        hit = sum(h for h, _ in runs) / len(runs)
        left = sum(n for _, n in runs) / len(runs)
        spread = f" ({min(h for h, _ in runs):.1%}-{max(h for h, _ in runs):.1%})" if len(runs) > 1 else ""
        rows.append(f"| {family} | {name} | {hit:.1%}{spread} | {left:.0f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement_rules", description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(TRACE_FAMILIES))
    parser.add_argument("--start", type=float, default=600.0, help="the window's start, trace seconds")
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kv-tokens", type=int, default=342068, help="KV per worker (the trace families' default)")
    parser.add_argument("--max-context", type=int, default=32768, help="the preset's max_model_len")
    parser.add_argument("--recent-s", type=float, default=10.0, help="trace seconds a worker's load counts back")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    args = parser.parse_args(argv)
    print("# Placement rules on a trace window's caches\n")
    print("Command: `python -m bench.placement_rules" + "".join(f" {a}" for a in (argv if argv is not None
          else sys.argv[1:])) + "`. The model and the rules: the module docstring of bench/placement_rules.py.\n")
    print(f"Window {args.start:.0f}-{args.start + args.duration:.0f} s, {args.workers} workers of {args.kv_tokens} "
          f"tokens of KV, load = tokens prefilled in the last {args.recent_s:g} trace seconds.\n")
    print("| family | rule (a prompt goes to the worker holding more than half its blocks, else:) | prefix hit | "
          "holders left |")
    print("|---|---|---|---|")
    for family in args.families.split(","):
        path = trace_path(family, args.trace_dir)
        if not path.exists() or not path.stat().st_size:
            continue
        reqs = load_window(family, path, args.start, args.duration, args.max_context, args.kv_tokens, "",
                           BlockVocabulary()).requests
        print("\n".join(table(family, reqs, args.workers, args.kv_tokens, args.recent_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
