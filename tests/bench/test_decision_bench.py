"""`kvroute bench decision` in miniature: it times RoutingService.pick on live fleets and writes its result files."""

from __future__ import annotations

import argparse
import json

from bench import decision


def test_the_decision_bench_times_every_policy_and_size_and_writes_md_and_json(tmp_path, monkeypatch):
    monkeypatch.setattr(decision, "WARMUP", 50)
    parser = argparse.ArgumentParser()
    decision.add_arguments(parser)
    args = parser.parse_args(["--decisions", "100", "--sizes", "10,60", "--out-dir", str(tmp_path)])
    assert decision.run(args) == 0
    [md] = tmp_path.glob("*-decision.md")
    [raw] = tmp_path.glob("*-decision.json")
    rows = json.loads(raw.read_text())["rows"]
    assert {(r["policy"], r["workers"]) for r in rows} == {(p, n) for p in ("kv_aware", "kv_cost") for n in (10, 60)}
    for row in rows:
        assert row["decisions"] + row["held"] == 100 and row["held"] == 0
        assert 0 < row["p50_us"] <= row["p99_us"]
    assert "| kv_aware | 60 |" in md.read_text()
