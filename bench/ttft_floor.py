"""The TTFT floor of a workload: what no router can beat on the sim, and where issue 9's 0.7x bar lies below it.

Owns the per-request lower bound and its comparison with a quality result file; routers and engines are
not involved (nothing is sent).

For each request of a family's saved workload, in its nominal order, the floor is the time of the engine
steps that prefill the part of its prompt that no earlier request presented (its leading full blocks seen
before in any request count as cached, on whichever worker a router would have had to send it), with the
sim's own tokenizer, block hashing and step-time model (backends/sim/tokens.py, kvcache.py, cost.py), in
chunks of the preset's token budget per step and nothing else in those steps. A router only adds to it:
a request can wait for a step to end, share its steps with other requests, find its prefix elsewhere or
evicted. So the floor's p99 over a cell's 1000 requests is a lower bound for any route's TTFT p99 there
(up to the order the requests reach the engines, which a loaded closed loop can change a little), and
where 0.7 x the best peer's p99 lies below it, the bar cannot be met by any router.

A closed loop's p99 is its first wave's (every client's first request onto a cold fleet at once, ~13% of a
cell). Its floor: for 11 requests to reach their first token no sooner than t (the p99 of 1000 is the 990th),
the fleet must have prefilled by t all but 10 of the wave, at least the wave's work without its 10 largest
requests (each shared prefix counted once, for the first request presenting it), at no more than each
worker's full-budget prefill rate (a step of max_num_batched_tokens new tokens; smaller steps are slower
per token, and attention's quadratic part is left out).

A trace family (trace_conversation, trace_synthetic) is floored the same way over the window a result file
names (--result) or --trace-start/--trace-duration give: each request's leading 512-token blocks that an
earlier request of the window presented count as cached, the rest is prefilled alone. Its bar is issue 34's
(0.8x the best peer, at p90 and p99).

A trace cell also gets a queue floor (`queue_floor`): the same prefill times at the cell's arrival times, on a
fleet relaxed in a router's favour. One least-recently-used cache of the whole fleet's KV, no block held twice and
every engine able to use every block (bench/trace_hit_bound.py's `pooled`: the fleet's KV with no copies); each
request to the engine that frees first, engines working one prefill after another in arrival order (vLLM's
first-come-first-served; a proxy that holds requests and binds them late reaches that); no decode work, no running
request's KV taking cache room. A model, not a strict bound (as trace_hit_bound's), but every real route pays some
of what it leaves out, so where 0.8x the best peer lies near or below the queue floor, the bar asks a router for more
than placement can give.

Run: python -m bench.ttft_floor [--result bench/results/<quality>.json] [--families ...]
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from backends.sim.cost import StepWork, step_time_s
from backends.sim.kvcache import block_hashes
from backends.sim.presets import Preset, get_preset
from backends.sim.tokens import chat_prompt
from bench.loadgen import percentile
from bench.trace_hit_bound import BlockCache
from bench.traces import BLOCK_TOKENS, TRACE_DIR, TRACE_FAMILIES, TraceRequest, read_trace, trace_path
from bench.workloads import KINDS, load_or_generate

PRESET = "h100-qwen3-vl-8b"
BAR = 0.7  # issue 9: kvroute's TTFT p99 at most this times the best peer's
TRACE_BAR = 0.8  # issue 34, on a recorded trace: TTFT p90 and p99 at most this times the best peer's


def request_floor_s(preset: Preset, prompt_ids: list[int], media_spans: list[tuple[int, int]],
                    cached_tokens: int) -> float:
    """Seconds of the steps that prefill tokens [cached_tokens, len) of one prompt, alone on the engine."""
    total = len(prompt_ids)
    start = min(cached_tokens, total - 1)  # the engine always computes the last token
    budget = preset.max_num_batched_tokens
    seconds = 0.0
    while start < total:
        num_new = min(total - start, budget)
        image = sum(max(0, min(start + num_new, s + n) - max(start, s)) for s, n in media_spans)
        seconds += step_time_s(preset, StepWork(
            prefill_tokens=num_new, prefill_seqs=1, kv_tokens_read=start + num_new,
            attention_pairs=num_new * start + num_new * (num_new + 1) // 2, image_tokens=image))
        start += num_new
    return seconds


def family_floors(kind: str, preset: Preset, seed: int = 1, n: int = 1000) -> list[float]:
    """Each request's floor (seconds), in the workload's nominal order."""
    workload = load_or_generate(kind, seed, n)
    seen: set[int] = set()
    floors = []
    bs = preset.block_size
    for spec in workload.specs(1.0):
        prompt = chat_prompt(spec.body["messages"])
        hashes = block_hashes(prompt.token_ids, bs)
        cached = 0
        for h in hashes:
            if h not in seen:
                break
            cached += 1
        seen.update(hashes)
        floors.append(request_floor_s(preset, prompt.token_ids, prompt.media_spans, cached * bs))
    return floors


def window_requests(family: str, preset: Preset, start_s: float, duration_s: float,
                    trace_dir: Path = TRACE_DIR) -> list[TraceRequest]:
    """The requests of a trace's window the quality bench sends (prompt and output within the preset's context)."""
    return [r for r in read_trace(trace_path(family, trace_dir))
            if start_s <= r.t_s < start_s + duration_s and r.input_length + max(1, r.output_length) <= preset.max_model_len]


def trace_floors(family: str, preset: Preset, start_s: float, duration_s: float,
                 trace_dir: Path = TRACE_DIR) -> list[float]:
    """Each request's floor (seconds) in a trace's window, in arrival order, over the requests the quality bench
    keeps (prompt and output within the preset's context)."""
    seen = BlockCache()  # unbounded: every block presented before
    floors = []
    for r in window_requests(family, preset, start_s, duration_s, trace_dir):
        cached = seen.leading(r.hash_ids)
        seen.present(r.hash_ids)
        floors.append(request_floor_s(preset, [0] * r.input_length, [], min(cached * BLOCK_TOKENS, r.input_length)))
    return floors


def queue_floor(requests: list[TraceRequest], preset: Preset, workers: int, kv_tokens_per_worker: int,
                speedup: float) -> tuple[list[float], float]:
    """(each request's TTFT in seconds, the share of prompt tokens found cached) on the relaxed fleet of the module
    docstring, the window replayed `speedup` times faster than recorded."""
    cache = BlockCache(workers * (kv_tokens_per_worker // BLOCK_TOKENS))
    free_at = [0.0] * workers  # a heap: when each engine finishes the prefills it was given
    ttfts: list[float] = []
    hit = total = 0
    start = requests[0].t_s if requests else 0.0
    for r in requests:
        found = min(cache.leading(r.hash_ids) * BLOCK_TOKENS, r.input_length - 1)
        hit, total = hit + found, total + r.input_length
        cache.present(r.hash_ids)
        arrival = (r.t_s - start) / speedup
        begins = max(arrival, heapq.heappop(free_at))
        done = begins + request_floor_s(preset, [0] * r.input_length, [], found)
        heapq.heappush(free_at, done)
        ttfts.append(done - arrival)
    return ttfts, (hit / total if total else 0.0)


def closed_wave_floor_s(kind: str, preset: Preset, clients: int, workers: int, seed: int = 1, n: int = 1000,
                        slower: int = 10) -> float:
    """Lower bound on a closed loop's TTFT p99 set by its first wave (see module docstring)."""
    workload = load_or_generate(kind, seed, n)
    seen: set[int] = set()
    work = []
    bs = preset.block_size
    for spec in workload.specs(1.0):
        if len(work) == clients:
            break
        if spec.after is not None:  # a session's next turn waits for the previous one: not in the wave
            continue
        prompt = chat_prompt(spec.body["messages"])
        hashes = block_hashes(prompt.token_ids, bs)
        fresh = [h for h in hashes if h not in seen]
        seen.update(hashes)
        work.append(len(prompt.token_ids) - (len(hashes) - len(fresh)) * bs)
    needed = sum(sorted(work)[:max(0, len(work) - slower)])
    budget = preset.max_num_batched_tokens
    rate = budget / step_time_s(preset, StepWork(prefill_tokens=budget, prefill_seqs=1, kv_tokens_read=budget))
    return needed / (workers * rate)


def p99(values: list[float]) -> float:
    """As the quality bench computes a cell's p99 (interpolated: at least the 990th of 1000)."""
    return percentile(values, 99.0) or 0.0


def _cells(result: dict[str, Any], key: str = "ttft_p99") -> dict[tuple[str, str], dict[str, list[float]]]:
    cells: dict[tuple[str, str], dict[str, list[float]]] = {}
    for row in result["rows"]:
        if row.get(key) is None:
            continue
        cells.setdefault((row["family"], str(row["load"])), {}).setdefault(row["route"], []).append(row[key])
    return cells


def _best_peer_and_kvroute(routes: dict[str, list[float]]) -> tuple[float, str] | None:
    """A cell's best peer's mean (seconds; kvroute and the oracle are no peers) and kvroute's default's mean in ms
    as shown ("-" when it did not run); None without a peer."""
    peers = [sum(v) / len(v) for r, v in routes.items() if not r.startswith(("kvroute", "oracle"))]
    if not peers:
        return None
    mine = routes.get("kvroute:default")
    return min(peers), f"{sum(mine) / len(mine) * 1e3:.0f}" if mine else "-"


def _bar_cells(result: dict[str, Any], floors: Mapping[str, object], *key: str
               ) -> Iterator[tuple[str, str, float, str]]:
    """(family, load, best peer's mean, kvroute's mean as shown) of each cell with a floor and a peer, in order."""
    for (family, load), routes in sorted(_cells(result, *key).items()):
        found = _best_peer_and_kvroute(routes) if family in floors else None
        if found is not None:
            yield family, load, *found


def compare_traces(result: dict[str, Any], floors: dict[str, list[float]]) -> list[str]:
    """Markdown rows: per trace cell and percentile, the window's floor against 0.8 x the best peer's mean and
    kvroute's."""
    lines = ["| family | load | percentile | floor ms | best peer ms | 0.8 x best peer ms | kvroute default ms "
             "| bar reachable |", "|---|---|---|---|---|---|---|---|"]
    for pct, key in ((90, "ttft_p90"), (99, "ttft_p99")):
        for family, load, best, kv in _bar_cells(result, floors, key):
            floor_ms, bar_ms = (percentile(floors[family], float(pct)) or 0.0) * 1e3, TRACE_BAR * best * 1e3
            lines.append(f"| {family} | {load} | p{pct} | {floor_ms:.0f} | {best * 1e3:.0f} | {bar_ms:.0f} | {kv} | "
                         f"{'yes' if bar_ms >= floor_ms else 'no: below the floor'} |")
    return lines


def cell_queue_floor(result: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], requests: list[TraceRequest],
                     preset: Preset) -> tuple[list[float], float]:
    """queue_floor of a trace cell of a quality result: its window's `requests` at the mean speed-up of the cell's
    `rows` (repeats), on the result's fleet (workers, KV per worker)."""
    family = rows[0]["family"]
    speedup = sum(r["trace_speedup"] for r in rows) / len(rows)
    return queue_floor(requests, preset, int(result["meta"]["workers"]),
                       result["meta"]["families"][family]["kv_tokens"], speedup)


def compare_queue(result: dict[str, Any], preset: Preset, trace_dir: Path = TRACE_DIR) -> list[str]:
    """Markdown rows: per trace cell of a result, the queue floor's p90 and p99 (module docstring) at the cell's
    speed-up beside the best peer's and kvroute's means, and each over the best peer's."""
    lines = ["| family | window s | load | pooled hit | queue floor p90 / p99 ms | best peer p90 / p99 ms | "
             "queue floor over best peer | kvroute over best peer |", "|---|---|---|---|---|---|---|---|"]
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in result["rows"]:
        if row.get("family") in TRACE_FAMILIES and row.get("trace_speedup") and row.get("ttft_p90") is not None:
            cells.setdefault((row["family"], str(row["load"])), []).append(row)
    for (family, load), rows in sorted(cells.items()):
        start, duration = rows[0]["trace_start_s"], rows[0]["trace_duration_s"]
        requests = window_requests(family, preset, start, duration, trace_dir)
        ttfts, hit = cell_queue_floor(result, rows, requests, preset)
        floor = [(percentile(ttfts, q) or 0.0) * 1e3 for q in (90.0, 99.0)]
        best, mine = [], []
        for key in ("ttft_p90", "ttft_p99"):
            found = _best_peer_and_kvroute(_cells({"rows": rows}, key)[(family, load)])
            best.append(found[0] * 1e3 if found else float("nan"))
            mine.append(found[1] if found else "-")
        over = " / ".join(f"{f / b:.2f}x" for f, b in zip(floor, best, strict=True))
        kv_over = " / ".join("-" if m == "-" else f"{float(m) / b:.2f}x" for m, b in zip(mine, best, strict=True))
        lines.append(f"| {family} | {start:.0f}-{start + duration:.0f} | {load} | {100 * hit:.1f}% | {floor[0]:.0f} / "
                     f"{floor[1]:.0f} | {best[0]:.0f} / {best[1]:.0f} | {over} | {kv_over} |")
    return lines


def compare(result: dict[str, Any], floors: dict[str, float], closed: dict[str, float] | None = None) -> list[str]:
    """Markdown rows: per cell, the floor's p99 (a closed loop's: the larger of it and its first wave's)
    against 0.7 x the best peer's mean p99 and kvroute's."""
    lines = ["| family | load | floor p99 ms | best peer p99 ms | 0.7 x best peer ms | kvroute default p99 ms "
             "| bar reachable |", "|---|---|---|---|---|---|---|"]
    for family, load, best, kv in _bar_cells(result, floors):
        floor = floors[family]
        if load == "closed" and closed and family in closed:
            floor = max(floor, closed[family])
        floor_ms, bar_ms = floor * 1e3, BAR * best * 1e3
        lines.append(f"| {family} | {load} | {floor_ms:.0f} | {best * 1e3:.0f} | {bar_ms:.0f} | {kv} | "
                     f"{'yes' if bar_ms >= floor_ms else 'no: below the floor'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ttft_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(KINDS))
    parser.add_argument("--result", type=Path, help="a `kvroute bench quality` JSON to compare with")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--clients-per-worker", type=int, default=32, help="the closed loop's (quality.py's)")
    parser.add_argument("--trace-start", type=float, help="a trace window's start (default: the result's)")
    parser.add_argument("--trace-duration", type=float, help="a trace window's length (default: the result's)")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    args = parser.parse_args(argv)
    preset = get_preset(PRESET)
    result = json.loads(args.result.read_text()) if args.result else None
    traces = [f for f in args.families.split(",") if f in TRACE_FAMILIES]
    if traces:
        return _main_traces(args, preset, traces, result)
    floors: dict[str, float] = {}
    closed: dict[str, float] = {}
    print("# TTFT floor: what no router can beat on the sim\n")
    print("Command: `python -m bench.ttft_floor" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
          + "`. How it is computed: the module docstring of bench/ttft_floor.py. Nothing is run: the saved "
          "workloads, the sim's tokenizer and step-time model only.\n")
    print(f"Floor per family (preset {PRESET}, 1000 requests, seed 1; simulated ms; the closed loop's first wave "
          f"with {args.workers} workers x {args.clients_per_worker} clients):\n")
    print("| family | floor p50 | floor p99 | floor max | requests with floor > 30 ms | closed loop's first wave |")
    print("|---|---|---|---|---|---|")
    for kind in args.families.split(","):
        values = family_floors(kind, preset)
        floors[kind] = p99(values)
        closed[kind] = closed_wave_floor_s(kind, preset, args.workers * args.clients_per_worker, args.workers)
        print(f"| {kind} | {sorted(values)[len(values) // 2] * 1e3:.1f} | {floors[kind] * 1e3:.1f} | "
              f"{max(values) * 1e3:.1f} | {sum(v > 0.030 for v in values)} | {closed[kind] * 1e3:.1f} |")
    if result is not None:
        print(f"\nAgainst {args.result.name} (means over repeats):\n")
        print("\n".join(compare(result, floors, closed)))
    return 0


def _window(result: dict[str, Any] | None, family: str, args: argparse.Namespace) -> tuple[float, float]:
    row = next((r for r in (result or {}).get("rows", []) if r.get("family") == family), {})
    start = args.trace_start if args.trace_start is not None else row.get("trace_start_s")
    duration = args.trace_duration if args.trace_duration is not None else row.get("trace_duration_s")
    if start is None or duration is None:
        raise SystemExit(f"{family}: give --trace-start and --trace-duration, or a --result that ran it")
    return float(start), float(duration)


def _main_traces(args: argparse.Namespace, preset: Preset, traces: list[str], result: dict[str, Any] | None) -> int:
    print("# TTFT floor on trace windows: what no router can beat on the sim\n")
    print("Command: `python -m bench.ttft_floor" + "".join(f" {a}" for a in sys.argv[1:])
          + "`. How it is computed: the module docstring of bench/ttft_floor.py.\n")
    print("| family | window s | requests | floor p50 ms | floor p90 ms | floor p99 ms | floor max ms |")
    print("|---|---|---|---|---|---|---|")
    floors: dict[str, list[float]] = {}
    for family in traces:
        start, duration = _window(result, family, args)
        values = trace_floors(family, preset, start, duration, args.trace_dir)
        floors[family] = values
        print(f"| {family} | {start:.0f}-{start + duration:.0f} | {len(values)} | "
              + " | ".join(f"{(percentile(values, q) or 0.0) * 1e3:.0f}" for q in (50.0, 90.0, 99.0))
              + f" | {max(values) * 1e3:.0f} |")
    if result is not None:
        print(f"\nAgainst {args.result.name} (means over repeats):\n")
        print("\n".join(compare_traces(result, floors)))
        print(f"\nThe queue floor of each cell of {args.result.name} (module docstring: one pooled cache of the fleet's "
              "KV, each request to the engine that frees first, prefill only; means over repeats):\n")
        print("\n".join(compare_queue(result, preset, args.trace_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
