"""The goodput sweep of `kvroute bench disagg --sweep` (DistServe's goodput: the highest sustainable rate).

Owns the sweep's rules, not its processes: the multipliers and their order, the salt that makes each step's prompts
new to every cache, waiting for a fleet to be idle between steps, stepping up until the first step whose SLO
attainment (the share of requests meeting TTFT and TPOT) is below the target, and the sustained rate that results.
bench/disagg.py starts the fleet and router once per (family, route, repeat) and measures each step; the tables are
bench/disagg_report.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from bench.loadgen import RequestSpec

ATTAINMENT = 0.9  # DistServe's target: 90% of requests within the SLO
IDLE_DEADLINE_S = 60.0  # wall seconds to wait for a fleet to drain between steps before measuring anyway
IDLE_POLL_S = 0.2


class SimStates(Protocol):
    def sim_states(self) -> list[dict]: ...


def parse_multipliers(text: str) -> list[float]:
    """`1,1.25,1.5` -> [1.0, 1.25, 1.5]: distinct, positive, in increasing order; empty text: no sweep."""
    values = sorted({float(item) for item in text.split(",") if item.strip()})
    if any(v <= 0 for v in values):
        raise ValueError(f"--sweep {text!r}: every multiplier must be above 0")
    return values


def passes(attainment: float, target: float) -> bool:
    return attainment >= target


def sustained_rate(steps: Iterable[tuple[float, float]], target: float) -> float:
    """The highest rate of a passing step before the first failing one, over (rate, attainment) steps in
    increasing rate; 0 when the first step fails. A pass after a fail does not count: goodput is what the route
    sustains at every rate up to it."""
    best = 0.0
    for rate, attainment in sorted(steps, key=lambda step: step[0]):
        if not passes(attainment, target):
            break
        best = rate
    return best


def run_steps(multipliers: Sequence[float], target: float, run_step: Callable[[float], dict[str, Any]],
              record: Callable[[dict[str, Any]], None]) -> None:
    """Run `run_step(multiplier)` in increasing order, `record` each step's row (it carries "attainment"), and
    stop after the first step below the target."""
    for multiplier in sorted(multipliers):
        row = run_step(multiplier)
        record(row)
        if not passes(row["attainment"], target):
            return


def sustained_record(family: str, route: str, repeat: int, steps: Sequence[dict[str, Any]],
                     target: float) -> dict[str, Any]:
    """A (family, route, repeat)'s result: its sustained rate and where its sweep stopped."""
    rate = sustained_rate(((s["rate"], s["attainment"]) for s in steps), target)
    failed = [s["multiplier"] for s in steps if not passes(s["attainment"], target)]
    return {"family": family, "route": route, "repeat": repeat, "sustained_rate": rate,
            "sustained_multiplier": max((s["multiplier"] for s in steps if s["rate"] == rate), default=0.0),
            "steps": len(steps), "stopped_at": failed[0] if failed else None}


def salted(specs: list[RequestSpec], salt: str) -> list[RequestSpec]:
    """Put `salt` at the head of every request's first message, so no cache warmed by an earlier step (engines'
    prefix caches, the routers' prefix indexes) matches any of this step's prompts. `Workload.specs` salts only
    the shared system prompts and images; a prompt without one (long_prompt, mixed_images' documents) would
    otherwise repeat from step to step on the same fleet."""
    mark = f"[{salt}] "
    for spec in specs:
        first = spec.body["messages"][0]
        content = first["content"]
        if isinstance(content, str) and not content.startswith(mark):
            first["content"] = mark + content
        elif isinstance(content, list):
            first["content"] = [{"type": "text", "text": mark}, *content]
    return specs


def idle(states: Sequence[dict]) -> bool:
    """Every sim has nothing running, queued, in flight, awaiting KV or holding KV for a transfer."""
    busy = ("num_running", "num_waiting", "in_flight", "awaiting_remote_kv", "blocks_held_for_transfer")
    return all(state and not any(state.get(key) for key in busy) for state in states)


def wait_until_idle(fleet: SimStates, deadline_s: float = IDLE_DEADLINE_S, poll_s: float = IDLE_POLL_S) -> float:
    """Poll the sims' /sim/state until the fleet is idle; the seconds waited, or -1 when the deadline passed first
    (the step is then measured anyway and its row says so)."""
    t0 = time.monotonic()
    while not idle(fleet.sim_states()):
        if time.monotonic() - t0 >= deadline_s:
            return -1.0
        time.sleep(poll_s)
    return time.monotonic() - t0
