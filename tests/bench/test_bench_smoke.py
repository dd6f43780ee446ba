"""Smoke runs of the benchmarks: tiny sizes, kvroute vs direct only (no peers), real processes.

They check that each family produces its results table and that no request failed; they do
not judge speed (the full benchmark runs do that, outside `make test`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from bench.report import CDF_QUANTILES
from tests.support.procs import KVROUTE, wait_until

pytestmark = pytest.mark.timeout(150)


def _run_bench(procs, out_dir: Path, *args: str, timeout: float = 120.0) -> str:
    # the marker is inherited by every process the bench starts, so the test can find leftovers
    proc = procs.start([*KVROUTE, "bench", *args, "--out-dir", str(out_dir)], name="bench",
                       env={"KVROUTE_BENCH_MARK": str(out_dir)})
    wait_until(lambda: not proc.alive(), timeout, 0.2, f"kvroute bench {args[0]} to finish")
    log = proc.log()
    assert proc.popen.returncode == 0, log[-3000:]
    return log


def _table_rows(md: str, first_cell: str) -> list[list[str]]:
    rows = []
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells and re.fullmatch(first_cell, cells[0]):
            rows.append(cells)
    return rows


def _processes_marked(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"KVROUTE_BENCH_MARK={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone, or not ours to read
    return found


def test_overhead_smoke_produces_table_with_no_failed_requests(procs, tmp_path):
    _run_bench(procs, tmp_path, "overhead", "--scale", "0.05", "--warmup", "20", "--no-peers", "--bare-relay",
               "--policies", "kv_aware", "--workloads", "stream,nonstream", "--repeats", "2")
    md_files = list(tmp_path.glob("*-overhead.md"))
    assert len(md_files) == 1
    md = md_files[0].read_text()
    rows = _table_rows(md, r"direct|direct \(again\)|kvroute:kv_aware|bare-relay:round_robin")
    # per run: direct, kvroute, the bare relay, direct again x two repeats x two workloads; then kvroute and the
    # bare relay over the repeats per workload
    assert len(rows) == 2 * 2 * 4 + 2 * 2, md
    assert "## Over the repeats: median (min..max)" in md
    assert [r[1] for r in rows[-4:]] == ["2"] * 4, md  # the summary rows count both repeats
    rows_json = json.loads(next(tmp_path.glob("*-overhead.json")).read_text())
    assert {(r["route"], r["workload"], r["repeat"]) for r in rows_json} == {
        (route, wl, k) for route in ("direct", "kvroute:kv_aware", "bare-relay:round_robin", "direct (again)")
        for wl in ("stream", "nonstream") for k in (0, 1)}
    for r in rows_json:
        assert r["failed"] == 0 and r["rejected"] == 0, r
        assert r["ok"] == r["requests"] == 100
    for route in ("kvroute:kv_aware", "bare-relay:round_robin"):
        row = next(r for r in rows_json if r["route"] == route and r["workload"] == "stream")
        assert row["cpu_us_per_req"] > 0 and row["rss_mb"] > 0  # the router's /proc figures were read
    bare = [r for r in rows_json if r["route"] == "bare-relay:round_robin"]
    assert all(r["spread"] == 0 for r in bare), bare  # round robin: every worker served the same count
    # the bench draws nothing; each row keeps its latency CDF for `kvroute bench plot`
    assert not list(tmp_path.glob("*.png"))
    assert all(len(r["latency_cdf"]) == len(CDF_QUANTILES) for r in rows_json), rows_json
    wait_until(lambda: not _processes_marked(str(tmp_path)), 10, 0.2, "the bench's processes to be gone")


@pytest.mark.timeout(330)
def test_quality_smoke_runs_sessions_through_kvroute_and_the_oracle_on_fresh_fleets(procs, tmp_path):
    # the calibration is a closed loop through the oracle; the cells are open loop at 80% of it
    _run_bench(procs, tmp_path, "quality", "--families", "sessions", "--loads", "0.8", "--routes",
               "kvroute:default,oracle", "--requests", "40", "--repeats", "1", "--workers", "2",
               "--closed-clients", "8", "--calibrate-requests", "40", "--calibrate-routes", "oracle", "--time-scale", "4", timeout=300)
    md = next(tmp_path.glob("*-quality-matrix-sessions.md")).read_text()
    assert "QUICK RUN: NOT MEANINGFUL" in md  # 60 requests, 1 repeat: marked as such
    rows = _table_rows(md, r"closed loop|80%")
    assert sorted((r[0], r[1].split(" ")[0]) for r in rows) == [("80%", "kvroute:default"), ("80%", "oracle")], md
    data = json.loads(next(tmp_path.glob("*-quality-matrix-sessions.json")).read_text())
    assert data["meta"]["quick"] and data["meta"]["families"]["sessions"]["capacity"] > 0
    assert not data["failed_cells"]
    for r in data["rows"]:
        assert r["failed"] == 0 and r["rejected"] == 0 and r["ok"] == r["requests"] == 40, r
        assert r["ttft_p99"] is not None and r["makespan_s"] > 0
        # every request is counted by the engines themselves, on a fresh fleet per cell
        assert sum(r["per_worker"]) == 40, r
        # the turns of a session repeat its history: the engines must hit their prefix caches
        assert r["prefix_hit"] > 0.3, r
    # kvroute's own count of requests sent away from the worker caching most of their prompt (its /metrics)
    holders_left = {r["route"]: r["holders_left"] for r in data["rows"]}
    assert isinstance(holders_left["kvroute:default"], int) and holders_left["oracle"] is None, holders_left
    assert not list(tmp_path.glob("*.png"))  # the TTFT CDFs are in the JSON, for `kvroute bench plot`
    cdfs = data["meta"]["families"]["sessions"]["ttft_cdf"]["0.8"]
    assert set(cdfs) == {r["label"] for r in data["rows"]} and all(len(c) == len(CDF_QUANTILES) for c in cdfs.values())
    wait_until(lambda: not _processes_marked(str(tmp_path)), 10, 0.2, "the bench's processes to be gone")


@pytest.mark.timeout(200)
def test_quality_smoke_replays_a_trace_window_open_loop_and_names_it_in_every_row(procs, tmp_path):
    trace = Path(__file__).resolve().parents[2] / "bench" / "data" / "tiny_trace.jsonl"
    _run_bench(procs, tmp_path, "quality", "--trace", str(trace), "--trace-start", "2", "--trace-duration", "16",
               "--loads", "0.8", "--routes", "kvroute:default", "--repeats", "1", "--workers", "2",
               "--closed-clients", "4", "--calibrate-requests", "40", "--calibrate-routes", "kvroute:default",
               "--time-scale", "4", timeout=180)
    data = json.loads(next(tmp_path.glob("*-quality-matrix-trace_tiny.json")).read_text())
    assert data["meta"]["quick"] and not data["failed_cells"]
    fam = data["meta"]["families"]["trace_tiny"]
    window = [r for r in map(json.loads, trace.read_text().splitlines()) if 2000 <= r["timestamp"] < 18000]
    assert fam["trace_requests"] == len(window) and fam["capacity"] > 0
    (row,) = data["rows"]
    assert (row["trace"], row["trace_start_s"], row["trace_duration_s"]) == ("tiny_trace.jsonl", 2.0, 16.0)
    assert row["trace_sha256"] == hashlib.sha256(trace.read_bytes()).hexdigest()
    # open loop at 80% of capacity: the window played that many times faster than recorded
    assert row["trace_speedup"] == pytest.approx(0.8 * fam["capacity"] / fam["trace_rate"])
    assert row["failed"] == 0 and row["rejected"] == 0 and row["ok"] == row["requests"] == len(window), row
    assert sum(row["per_worker"]) == len(window)  # the engines' own count
    # every prompt token reached the engines (exact lengths), and turns of a conversation hit their caches
    assert row["prefill_tokens"] <= sum(r["input_length"] for r in window) and row["prefix_hit"] > 0.3, row
    md = next(tmp_path.glob("*-quality-matrix-trace_tiny.md")).read_text()
    assert f"Trace `tiny_trace.jsonl` (sha256 `{row['trace_sha256']}`), window 2-18 s" in md
    wait_until(lambda: not _processes_marked(str(tmp_path)), 10, 0.2, "the bench's processes to be gone")
