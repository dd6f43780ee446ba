"""Decision benchmark: what one routing decision costs the data plane (RoutingService.pick) at 10/100/1000 workers.

Owns the measurement only: a real Registry, PolicySet, AdmissionController and PrefixIndex built as
proxy/app.py builds them (no sockets, no engines), fed the way a running proxy is fed.

Per fleet size and policy, on a simulated clock (DECISIONS_PER_S decisions per second):
- every worker sends a load report every protocol.report_interval_for(workers) seconds
  (registry.record_report, as the control plane calls it): KV usage drifting around a per-worker level in 5..90%, running 0..64, and about a
  fifth of the workers queueing (num_waiting 1..8);
- each decision is `await RoutingService.pick(...)` for a parsed chat request whose system prompt is one of
  PROMPTS shared ones (Zipf-skewed, 200..2000 words, so the prefix index has hits) plus a unique
  question; the pick is followed by RoutingService.begin (prefix index insert, load accounting), its first
  output (RoutingService.first_output) FIRST_OUTPUT_AFTER_S later, and the oldest attempt is ended with
  RoutingService.end once IN_FLIGHT_PER_WORKER x workers are in flight;
- RETRY_SHARE of the decisions are also retried (tried = the first pick's worker, first_attempt False).

Timed around the awaited pick only: every other decision by wall clock (perf_counter_ns), the others
by this thread's CPU time (thread_time_ns, less the cost of reading it), which leaves out the time
other processes held the core (on a shared box they inflate the wall-clock p99 most). begin+end and
record_report are timed apart (they carry the bookkeeping that keeps the pick cheap). A warm-up of
WARMUP decisions comes first. Last, "quietest batch": the fastest of 200 batches of 10 picks on the
final state, per pick, a figure the box's other load hardly moves (for comparing code, not a percentile).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

import orjson

from bench.report import environment_note, fmt, md_table, results_path, write_json

FLEET_SIZES = (10, 100, 1000)
POLICIES = ("kv_aware", "kv_cost")
DECISIONS_PER_S = 2000.0
FIRST_OUTPUT_AFTER_S = 0.002  # simulated s from a dispatch to its first output: short, so engines keep admitting (picks, not holds, are timed)
IN_FLIGHT_PER_WORKER = 4
PROMPTS = 64
RETRY_SHARE = 0.05
WARMUP = 2000
CAPACITY_TOKENS = 300_000
MAX_MODEL_LEN = 32768


class SimClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _requests(rng: random.Random, n: int) -> list[Any]:
    """Parsed chat requests: PROMPTS shared system prompts (Zipf-skewed use) plus a unique question each."""
    from proxy.request import parse_request

    systems = [" ".join(f"w{rng.randrange(5000)}" for _ in range(200 + 1800 * k // (PROMPTS - 1)))
               for k in range(PROMPTS)]
    weights = [1.0 / (k + 1) for k in range(PROMPTS)]
    out = []
    for i in range(n):
        body = {"model": "m", "stream": True, "max_tokens": 128,
                "messages": [{"role": "system", "content": rng.choices(systems, weights)[0]},
                             {"role": "user", "content": f"question {i}: " + " ".join(
                                 f"q{rng.randrange(9999)}" for _ in range(rng.randint(10, 80)))}]}
        out.append(parse_request(orjson.dumps(body), "chat"))
    return out


class _Fleet:
    """n registered workers and their simulated engine readings."""

    def __init__(self, registry: Any, n: int, rng: random.Random) -> None:
        from proxy.protocol import WorkerRegistration

        self.registry = registry
        self.rng = rng
        self.ids = [f"w{i}" for i in range(n)]
        self.level = {wid: rng.uniform(0.05, 0.9) for wid in self.ids}
        self.queueing = {wid: rng.random() < 0.2 for wid in self.ids}
        self.seq = 0
        for i, wid in enumerate(self.ids):
            registry.register(WorkerRegistration(worker_id=wid, url=f"http://10.0.{i // 250}.{i % 250}:8000",
                                                 models=["m"], engine="vllm", kv_capacity_tokens=CAPACITY_TOKENS,
                                                 max_model_len=MAX_MODEL_LEN))
        self.next_report = 0  # round robin: each worker reports once per report interval

    def report(self, wid: str) -> float:
        """One load report through registry.record_report; its duration in microseconds."""
        from proxy.protocol import LoadReport

        rng = self.rng
        level = self.level[wid] = min(0.95, max(0.02, self.level[wid] + rng.gauss(0.0, 0.02)))
        if rng.random() < 0.02:
            self.queueing[wid] = not self.queueing[wid]
        self.seq += 1
        report = LoadReport.model_construct(
            worker_id=wid, url="", models=["m"], engine="vllm", state="ready", kv_cache_usage=level,
            kv_capacity_tokens=CAPACITY_TOKENS, num_running=rng.randrange(1, 65),
            num_waiting=rng.randint(1, 8) if self.queueing[wid] else 0, prefix_cache_hit_rate=0.5,
            prefill_tokens_per_s=None, decode_step_s=None, seq=self.seq, boot_id=None, sent_at=0.0)
        t0 = time.perf_counter_ns()
        self.registry.record_report(wid, report)
        return (time.perf_counter_ns() - t0) / 1000.0

    def reports_due(self, count: float) -> list[float]:
        times = []
        for _ in range(int(count)):
            times.append(self.report(self.ids[self.next_report]))
            self.next_report = (self.next_report + 1) % len(self.ids)
        return times


def _pick_now(coro: Any) -> Any:
    """Run an awaitable pick to its end as `await` would when it does not suspend; None if it would hold.

    (Driven by hand: wrapping it in asyncio.wait_for would time a task's creation too.)
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()  # held in the admission queue: leave it (the bench keeps an engine admitting, so rare)
    return None


def _thread_time_cost_ns() -> int:
    """The median cost of reading thread_time_ns twice (subtracted from the CPU-time samples)."""
    xs = []
    for _ in range(2001):
        a = time.thread_time_ns()
        xs.append(time.thread_time_ns() - a)
    return sorted(xs)[1000]


def _quietest_pick_us(dispatcher: Any, policy: Any, requests: list[Any], batches: int = 200, size: int = 10
                      ) -> float:
    """Mean pick time of the fastest of `batches` batches of `size` picks on the final fleet state (nothing
    dispatched between them): what a decision costs when no other process shares the core."""
    best = float("inf")
    for b in range(batches):
        batch = [requests[(b * size + k) % len(requests)] for k in range(size)]
        t0 = time.perf_counter_ns()
        for routed in batch:
            _pick_now(dispatcher.pick(policy, routed, "m", set(), True))
        best = min(best, (time.perf_counter_ns() - t0) / size / 1000.0)
    return best


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q))]


async def _one_cell(n: int, policy_name: str, decisions: int, requests: list[Any], seed: int) -> dict[str, Any]:
    from proxy.config import FleetConfig
    from proxy.protocol import report_interval_for
    from proxy.routing.base import PolicyDeps
    from proxy.routing.live import LiveConfig
    from proxy.routing.policy_set import PolicySet
    from proxy.routing.prefix_index import PrefixIndex
    from proxy.routing.service import InFlight, RoutingService
    from proxy.workers.registry import Registry

    rng = random.Random(seed)
    clock = SimClock()
    config = FleetConfig()
    registry = Registry(clock=clock)
    deps = PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(seed))
    policies = PolicySet(config, policy_name, deps)
    dispatcher = RoutingService(LiveConfig(config, policies), registry)
    policy = policies.for_model("m")
    fleet = _Fleet(registry, n, rng)
    fleet.reports_due(n)  # everyone has a reading
    reports_per_decision = n / report_interval_for(n) / DECISIONS_PER_S
    no_output_yet: deque[tuple[float, InFlight]] = deque()
    owed = 0.0
    in_flight: list[InFlight] = []
    max_in_flight = IN_FLIGHT_PER_WORKER * n
    pick_us: list[float] = []
    cpu_us: list[float] = []
    cpu_clock_ns = _thread_time_cost_ns()
    retry_us: list[float] = []
    begin_end_us: list[float] = []
    report_us: list[float] = []
    held = 0
    gc.collect()
    for i in range(WARMUP + decisions):
        timed = i >= WARMUP
        clock.now += 1.0 / DECISIONS_PER_S
        owed += reports_per_decision
        times = fleet.reports_due(owed)
        owed -= len(times)
        routed = requests[i % len(requests)]
        # even decisions: wall time; odd ones: this thread's CPU time (a busy box's preemptions left out)
        clock_ns = time.perf_counter_ns if i % 2 == 0 else time.thread_time_ns
        t0 = clock_ns()
        decision = _pick_now(dispatcher.pick(policy, routed, "m", set(), True))
        t1 = clock_ns()
        if decision is None:
            held += 1
            continue
        if rng.random() < RETRY_SHARE:
            tried = {decision.worker.worker_id}
            t2 = time.perf_counter_ns()
            _pick_now(dispatcher.pick(policy, routed, "m", tried, False))
            if timed:
                retry_us.append((time.perf_counter_ns() - t2) / 1000.0)
        t3 = time.perf_counter_ns()
        ticket = dispatcher.begin(decision, policy, routed)
        in_flight.append(ticket)
        no_output_yet.append((clock.now + FIRST_OUTPUT_AFTER_S, ticket))
        while no_output_yet[0][0] <= clock.now:
            dispatcher.first_output(no_output_yet.popleft()[1])
        ended = None
        if len(in_flight) > max_in_flight:
            ended = in_flight.pop(rng.randrange(len(in_flight) // 4 + 1))  # mostly the oldest finish first
            dispatcher.end(ended, clock.now)
        t4 = time.perf_counter_ns()
        if timed:
            if i % 2 == 0:
                pick_us.append((t1 - t0) / 1000.0)
            else:
                cpu_us.append((t1 - t0 - cpu_clock_ns) / 1000.0)
            begin_end_us.append((t4 - t3) / 1000.0)
            report_us.extend(times)
    quiet_us = _quietest_pick_us(dispatcher, policy, requests)
    for lst in (pick_us, cpu_us, retry_us, begin_end_us, report_us):
        lst.sort()
    row = {"workers": n, "policy": policy_name, "decisions": len(pick_us) + len(cpu_us), "held": held,
           "p50_us": _pct(pick_us, 0.5), "p99_us": _pct(pick_us, 0.99), "max_us": pick_us[-1],
           "cpu_p50_us": _pct(cpu_us, 0.5), "cpu_p99_us": _pct(cpu_us, 0.99), "quiet_us": quiet_us,
           "retry_p50_us": _pct(retry_us, 0.5) if retry_us else None,
           "retry_p99_us": _pct(retry_us, 0.99) if retry_us else None,
           "begin_end_p50_us": _pct(begin_end_us, 0.5), "report_p50_us": _pct(report_us, 0.5) if report_us else None}
    print(f"[decision] {n:>5} workers {policy_name:<9} pick p50 {row['p50_us']:.1f} us  p99 {row['p99_us']:.1f} us  "
          f"cpu p50 {row['cpu_p50_us']:.1f} us  p99 {row['cpu_p99_us']:.1f} us  quiet {quiet_us:.1f} us  "
          f"(retry p50 {fmt(row['retry_p50_us'])}, begin+end p50 {row['begin_end_p50_us']:.1f}, "
          f"report p50 {fmt(row['report_p50_us'])})", flush=True)
    return row


def decision_time(sizes: tuple[int, ...], policies: tuple[str, ...], decisions: int, seed: int = 0
                  ) -> list[dict[str, Any]]:
    requests = _requests(random.Random(seed), 1024)
    return [asyncio.run(_one_cell(n, name, decisions, requests, seed)) for n in sizes for name in policies]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decisions", type=int, default=5000, help="timed decisions per policy and fleet size")
    p.add_argument("--sizes", default=",".join(map(str, FLEET_SIZES)), help="fleet sizes, comma-separated")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--name", default="decision")


def run(args: argparse.Namespace) -> int:
    t_start = time.time()
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    policies = tuple(x for x in args.policies.split(",") if x)
    rows = decision_time(sizes, policies, args.decisions, args.seed)
    load = os.getloadavg()[0]
    out = [f"# Decision time\n\n{environment_note()}; run took {time.time() - t_start:.0f} s; load average "
           f"{load:.1f} at the end (a busy box inflates p99 most).\n",
           "`RoutingService.pick` as the data plane awaits it (admission, candidate filtering, policy), in-process, "
           f"{args.decisions} timed decisions per cell (half by wall clock, half by CPU time) after {WARMUP} warm-up ones; reports at "
           f"the interval the proxy asks of each fleet size (protocol.report_interval_for) at {DECISIONS_PER_S:g} decisions/s "
           f"(simulated clock), first output {FIRST_OUTPUT_AFTER_S * 1000:g} ms after each dispatch, "
           f"{IN_FLIGHT_PER_WORKER} requests in flight per worker, {PROMPTS} shared system prompts. "
           "Command: `python -m bench.decision` (`kvroute bench decision`).\n"]
    table = [[r["policy"], r["workers"], fmt(r["p50_us"]), fmt(r["p99_us"]), fmt(r["cpu_p50_us"]),
              fmt(r["cpu_p99_us"]), fmt(r["quiet_us"]), fmt(r["retry_p50_us"]), fmt(r["retry_p99_us"]), fmt(r["begin_end_p50_us"]),
              fmt(r["report_p50_us"]), r["held"]] for r in rows]
    out.append(md_table(["policy", "workers", "pick p50 us", "pick p99 us", "pick CPU p50 us", "pick CPU p99 us",
                         "quietest batch us/pick", "retry p50 us", "retry p99 us", "begin+end p50 us", "report p50 us", "held"], table))
    text = "\n".join(out) + "\n"
    results_path(args.name, ".md", args.out_dir).write_text(text)
    write_json(results_path(args.name, ".json", args.out_dir), {"rows": rows, "args": vars(args), "loadavg": load})
    print(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
