"""`kvroute bench disagg --sweep`: the sustained rate a sweep's steps give, the order it runs them and where it stops,
the salting that keeps each step's prompts cold, the idle wait, and the sweep's tables; plus the non-sweep pages,
which must render exactly as committed. No processes: the end-to-end run is the bench's own (bench/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.disagg_report import render
from bench.disagg_sweep import (
    idle,
    parse_multipliers,
    run_steps,
    salted,
    sustained_rate,
    sustained_record,
    wait_until_idle,
)
from bench.disagg_workloads import generate

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


# ---- the sustained rate ---------------------------------------------------------------------------------------------
def test_every_step_passing_sustains_the_highest_rate():
    assert sustained_rate([(30, 1.0), (45, 0.95), (60, 0.9)], 0.9) == 60  # exactly the target passes


def test_the_sustained_rate_is_the_last_pass_before_the_first_fail():
    assert sustained_rate([(30, 1.0), (45, 0.92), (60, 0.5), (75, 0.1)], 0.9) == 45


def test_a_first_step_below_the_target_sustains_nothing():
    assert sustained_rate([(30, 0.89), (45, 0.2)], 0.9) == 0


def test_a_pass_after_a_fail_does_not_count():
    assert sustained_rate([(30, 1.0), (45, 0.7), (60, 0.95), (90, 1.0)], 0.9) == 30
    assert sustained_rate([(60, 0.95), (45, 0.7), (30, 1.0)], 0.9) == 30  # by rate, whatever the list's order


def test_the_record_says_where_the_sweep_stopped():
    steps = [{"multiplier": 1.0, "rate": 30.0, "attainment": 1.0},
             {"multiplier": 1.5, "rate": 45.0, "attainment": 0.4}]
    assert sustained_record("mixed_images", "kvroute:2p6d", 2, steps, 0.9) == {
        "family": "mixed_images", "route": "kvroute:2p6d", "repeat": 2, "sustained_rate": 30.0,
        "sustained_multiplier": 1.0, "steps": 2, "stopped_at": 1.5}
    assert sustained_record("f", "r", 0, steps[1:], 0.9)["sustained_rate"] == 0.0


# ---- the steps ------------------------------------------------------------------------------------------------------
def test_multipliers_are_distinct_and_increasing_and_empty_means_no_sweep():
    assert parse_multipliers("2, 1,1.5,1") == [1.0, 1.5, 2.0]
    assert parse_multipliers("") == []
    with pytest.raises(ValueError):
        parse_multipliers("0,1")


def _run(attainment: dict[float, float], multipliers: list[float]) -> list[float]:
    recorded: list[dict[str, Any]] = []
    run_steps(multipliers, 0.9, lambda m: {"multiplier": m, "attainment": attainment[m]}, recorded.append)
    return [row["multiplier"] for row in recorded]


def test_steps_run_in_increasing_order_and_stop_after_the_first_failing_one():
    assert _run({1: 1.0, 1.5: 0.95, 2: 0.6, 3: 1.0}, [3, 1, 2, 1.5]) == [1, 1.5, 2]  # the failing step is kept
    assert _run({1: 1.0, 2: 1.0}, [1, 2]) == [1, 2]
    assert _run({1: 0.1, 2: 1.0}, [1, 2]) == [1]


def test_each_salt_makes_every_prompt_new_even_those_without_a_shared_system_prompt():
    w = generate("mixed_images", 1, 24)
    a, b = (salted(w.specs(1.0, salt=s, limit=24), s) for s in ("step-a", "step-b"))
    documents = [i for i, spec in enumerate(a) if spec.body["messages"][0]["role"] == "user"]
    assert documents  # the family's long documents: Workload.specs leaves them unsalted
    for spec_a, spec_b in zip(a, b, strict=True):
        first_a, first_b = spec_a.body["messages"][0]["content"], spec_b.body["messages"][0]["content"]
        assert first_a.startswith("[step-a] ") and not first_a.startswith("[step-a] [step-a]")
        assert first_b.startswith("[step-b] ") and first_a.removeprefix("[step-a] ") == first_b.removeprefix("[step-b] ")


_IDLE = {"num_running": 0, "num_waiting": 0, "in_flight": 0, "awaiting_remote_kv": 0, "blocks_held_for_transfer": 0}


@pytest.mark.parametrize("busy", ["num_running", "num_waiting", "in_flight", "awaiting_remote_kv",
                                  "blocks_held_for_transfer"])
def test_a_fleet_is_idle_only_when_no_sim_has_work_or_holds_kv(busy):
    assert idle([_IDLE, _IDLE])
    assert not idle([_IDLE, {**_IDLE, busy: 3}])
    assert not idle([_IDLE, {}])  # a sim that did not answer is not known to be idle


class _Draining:
    """A fleet whose prefill sim holds KV for its first `polls` state reads."""

    def __init__(self, polls: int) -> None:
        self.reads, self.polls = 0, polls

    def sim_states(self) -> list[dict]:
        self.reads += 1
        return [_IDLE, {**_IDLE, "blocks_held_for_transfer": 0 if self.reads > self.polls else 12}]


def test_the_idle_wait_polls_until_the_fleet_drains_and_gives_up_at_its_deadline():
    fleet = _Draining(polls=3)
    assert wait_until_idle(fleet, deadline_s=1e9, poll_s=0) >= 0 and fleet.reads == 4
    assert wait_until_idle(_Draining(polls=10**9), deadline_s=0, poll_s=0) == -1


# ---- the tables -----------------------------------------------------------------------------------------------------
def _step(route: str, repeat: int, multiplier: float, attainment: float) -> dict[str, Any]:
    return {"family": "mixed_images", "route": route, "repeat": repeat, "multiplier": multiplier,
            "rate": 30 * multiplier, "attainment": attainment, "goodput_frac": attainment, "requests": 40, "ok": 40,
            "failed": 0, "ttft_p50": 0.3, "ttft_p99": 1.2, "itl_p50": 0.01, "itl_p99": 0.04, "tpot_p50": 0.02,
            "tpot_p99": 0.03, "req_per_s": 29.0, "output_tok_per_s": 3000.0, "kv_moved_gb": 1.5,
            "split_share": 0.4, "engine_lag_s": 0.1}


def _sweep_result() -> dict[str, Any]:
    attainments = {  # route -> per repeat, attainment at x1, x1.5, x2 (a sweep stops after its first fail)
        "kvroute:2p6d": [[1.0, 0.95, 0.5], [1.0, 0.92, 0.95]],
        "vllm-router:2p6d": [[0.95, 0.6], [0.91, 0.93, 0.2]],
        "vllm-router:3p5d": [[1.0, 1.0, 0.4], [1.0, 1.0, 0.95]],
        "aggregated": [[1.0, 0.95, 0.9], [0.5]],
    }
    rows, sustained = [], []
    for route, repeats in attainments.items():
        for repeat, values in enumerate(repeats):
            steps = [_step(route, repeat, m, a) for m, a in zip((1.0, 1.5, 2.0), values, strict=False)]
            rows += steps
            sustained.append(sustained_record("mixed_images", route, repeat, steps, 0.9))
    meta = {"environment": "test", "command": "kvroute bench disagg --sweep 1,1.5,2", "workers": 8,
            "preset": "h100-qwen3-vl-8b", "time_scale": 0.25, "requests": 40, "repeats": 2, "ttft_slo": 2.0,
            "itl_slo": 0.05, "link": "rdma-400g", "families": {"mixed_images": "a mix"}, "took_s": 60.0,
            "sweep": [1.0, 1.5, 2.0], "attainment": 0.9, "rates": {"mixed_images": 30.0}}
    return {"meta": meta, "rows": rows, "failed_cells": [], "sustained": sustained}


def _table_row(md: str, route: str) -> list[str]:
    return next([c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
                if line.startswith(f"| {route} |"))


def test_a_sweep_renders_each_routes_sustained_rate_its_ratio_and_its_attainment_per_step():
    md = render(_sweep_result())
    assert "| route | sustained req/s | vs vllm-router | x1 | x1.5 | x2 | engine lag s (max) |" in md
    # sustained: (45, 60) for kvroute, (30, 45) for vllm-router at 2p6d: medians 52.5 and 37.5
    assert _table_row(md, "kvroute:2p6d") == ["kvroute:2p6d", "52.50 (45.00-60.00)", "1.40x vllm-router:2p6d",
                                              "100%", "94%", "72%", "0.10"]
    assert _table_row(md, "vllm-router:2p6d")[1:6] == ["37.50 (30.00-45.00)", "0.71x vllm-router:3p5d", "93%",
                                                       "76%", "20% (1/2)"]
    # aggregated (60, 0) and every route but kvroute:SHAPE against the best vllm-router: 3p5d's (45, 60)
    assert _table_row(md, "aggregated")[1:6] == ["30.00 (0.00-60.00)", "0.57x vllm-router:3p5d", "75%",
                                                 "95% (1/2)", "90% (1/2)"]
    assert _table_row(md, "vllm-router:3p5d")[1:3] == ["52.50 (45.00-60.00)", "1.00x vllm-router:3p5d"]
    assert "- mixed_images, 2p6d: kvroute (conditional) 52.50 req/s sustained vs vllm-router PD 37.50: 1.40x " \
           "(bar: 1.2x) PASS" in md
    assert "highest offered rate at which at least 90% of requests meet" in md
    assert "| kvroute:2p6d | x2 | 60 | 2 | 72% |" in md  # the steps' own table


@pytest.mark.parametrize("stem", ["2026-12-03-disagg", "2026-12-03-disagg-mixed-multiturn"])
def test_a_run_without_sweep_renders_exactly_as_committed(stem):
    assert render(json.loads((RESULTS / f"{stem}.json").read_text())) == (RESULTS / f"{stem}.md").read_text()


def test_a_vllm_router_that_sustains_nothing_is_named_so_not_as_an_infinite_ratio():
    data = _sweep_result()
    for record in data["sustained"]:
        if record["route"] == "vllm-router:2p6d":
            record["sustained_rate"] = 0.0
    data["sustained"] = [r for r in data["sustained"] if r["route"] != "vllm-router:3p5d"]
    data["rows"] = [r for r in data["rows"] if r["route"] != "vllm-router:3p5d"]
    md = render(data)
    assert _table_row(md, "kvroute:2p6d")[2] == "vllm-router:2p6d sustained none"
    assert "infx" not in md


def test_each_kvroute_route_names_its_decision_and_a_bad_shape_is_refused():
    from bench.disagg import shape_of
    from bench.route_spec import parse_route_spec

    assert shape_of("kvroute:3p5d") == ("kvroute", "3p5d", "default")
    router, shape, spec = shape_of("kvroute-whole:2p6d")
    assert (router, shape) == ("kvroute", "2p6d")
    assert parse_route_spec(spec).proxy == {"routing": {"disagg": {"whole_on_prefill": True}}}
    assert parse_route_spec(shape_of("kvroute-split:4p4d")[2]).proxy == {"routing": {"disagg": {"split": "always"}}}
    with pytest.raises(ValueError):
        shape_of("kvroute-whole:8both")


# ---- --dump ---------------------------------------------------------------------------------------------------------
def test_dump_writes_each_requests_outcome_in_simulated_seconds(tmp_path: Path):
    from bench.disagg import dump_requests
    from bench.loadgen import Result, RunResult

    run = RunResult([Result(0, "document", 200, 0.5, 4.0, ttft_s=1.2, worker="sim-0,sim-4", prompt_tokens=8000,
                            completion_tokens=40, itl_s=0.08),
                     Result(1, "chat", 503, 0.75, 0.1, error="no_healthy_worker")], wall_s=5.0, started_at=0.0)
    path = tmp_path / "requests.jsonl"
    dump_requests(path, "mixed_images kvroute:3p5d #0 x2", run, 0.25)
    dump_requests(path, "mixed_images kvroute:3p5d #1 x2", run, 0.25)  # appended, not replaced
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4 and lines[2]["cell"] == "mixed_images kvroute:3p5d #1 x2"
    assert lines[0] == {"cell": "mixed_images kvroute:3p5d #0 x2", "tag": "document", "worker": "sim-0,sim-4",
                        "prompt_tokens": 8000, "completion_tokens": 40, "sent_s": 0.125, "ttft_s": 0.3,
                        "tpot_s": 0.02, "status": 200}
    assert (lines[1]["status"], lines[1]["ttft_s"], lines[1]["tpot_s"]) == (503, None, None)
