"""`kvroute bench plot RESULT.json`: the plots a bench used to write, drawn on demand from its JSON.

The benches keep latency/TTFT distributions as CDFs (bench/report.py) instead of PNGs; these tests draw
them, and the percentile bars for result files written before the JSON kept CDFs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.report import CDF_QUANTILES, cdf
from tests.support.procs import KVROUTE

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plot(result: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVROUTE, "bench", "plot", str(result), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_a_cdf_keeps_the_median_and_the_tail_of_the_samples():
    values = [i / 1000 for i in range(1, 1001)]  # 1..1000 ms
    points = cdf(values)
    assert len(points) == len(CDF_QUANTILES)
    assert points[0] == 0.001 and points[-1] == 1.0
    assert points[CDF_QUANTILES.index(0.5)] == pytest.approx(0.5, abs=0.002)
    assert points[CDF_QUANTILES.index(0.99)] == pytest.approx(0.99, abs=0.002)
    assert cdf([]) == []


def _quality_result(with_cdf: bool) -> dict:
    rows = [{"family": "sessions", "load": "0.8", "route": route, "label": route, "repeat": k,
             "ttft_p50": 0.02 * (k + 1), "ttft_p99": 0.2 * (k + 1)}
            for route in ("kvroute:default", "sglang-router:cache_aware") for k in range(2)]
    family = {"kv_tokens": 49152}
    if with_cdf:
        family["ttft_cdf"] = {"0.8": {"kvroute:default": cdf([0.01, 0.02, 0.5]),
                                      "sglang-router:cache_aware": cdf([0.02, 0.04, 0.9])}}
    return {"meta": {"families": {"sessions": family}}, "rows": rows, "failed_cells": []}


def _overhead_result(with_cdf: bool) -> list:
    rows = []
    for route in ("direct", "kvroute:kv_aware", "vllm-router:round_robin"):
        row = {"workload": "stream", "route": route, "repeat": 0, "cpu_us_per_req": None if route == "direct" else 500.0}
        if with_cdf:
            row["latency_cdf"] = cdf([0.05, 0.06, 0.2])
        rows.append(row)
    return rows


@pytest.mark.parametrize("kind,make,expected", [
    ("quality", _quality_result, {True: ["sessions-0.8-ttft-cdf.png"], False: ["sessions-0.8-ttft.png"]}),
    ("overhead", _overhead_result, {True: ["stream-latency-cdf.png"], False: ["stream-cpu.png"]}),
])
@pytest.mark.parametrize("with_cdf", [True, False])
def test_plot_draws_a_png_per_cell_from_the_json(tmp_path, kind, make, expected, with_cdf):
    result = tmp_path / f"2026-12-03-{kind}.json"
    result.write_text(json.dumps(make(with_cdf)))
    out = tmp_path / "plots"
    done = _plot(result, out)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"2026-12-03-{kind}-{n}" for n in expected[with_cdf]]
    for p in out.iterdir():
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000  # a drawn picture, not an empty file
    assert done.stdout.split() == [str(out / n) for n in names]


def test_plot_refuses_a_result_that_has_no_plots(tmp_path):
    result = tmp_path / "2026-12-03-decision.json"
    result.write_text(json.dumps({"rows": [{"policy": "kv_aware", "workers": 10}]}))
    done = _plot(result, tmp_path / "plots")
    assert done.returncode != 0 and "not a quality or overhead result" in done.stderr
    assert not (tmp_path / "plots").exists() or not list((tmp_path / "plots").iterdir())
