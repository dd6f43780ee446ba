"""`kvroute bench plot RESULT.json [--out DIR]`: a result file's plots, drawn on demand as PNGs.

Owns the drawing; the benches keep what it draws in their JSON (CDFs sampled at report.CDF_QUANTILES),
so no picture is committed. Files made before the JSON kept CDFs get bars of the percentiles they hold.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import CDF_QUANTILES

DEFAULT_OUT = Path(__file__).resolve().parent / ".plots"  # gitignored


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("kvroute bench plot needs matplotlib: pip install 'kvroute[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", text).strip("-")


def draw_cdfs(path: Path, series: dict[str, Sequence[float]], title: str, xlabel: str) -> None:
    """One CDF line per label from values (seconds) at CDF_QUANTILES, on a log axis in ms."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, values in series.items():
        if len(values) != len(CDF_QUANTILES):
            continue  # a route with no samples, or a CDF sampled elsewhere than this code knows
        ax.plot([v * 1000.0 for v in values], CDF_QUANTILES, label=label, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_bars(path: Path, bars: dict[str, dict[str, float]], title: str, ylabel: str) -> None:
    """Grouped bars: label -> {series: value}; for files that hold percentiles but no CDF."""
    plt = _pyplot()
    labels = list(bars)
    series = list(dict.fromkeys(s for v in bars.values() for s in v))
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.45 * len(labels) * max(1, len(series))), dpi=110)
    height = 0.8 / max(1, len(series))
    for k, name in enumerate(series):
        ys = [i + k * height for i in range(len(labels))]
        ax.barh(ys, [bars[label].get(name, 0.0) for label in labels], height=height, label=name)
    ax.set_yticks([i + height * (len(series) - 1) / 2 for i in range(len(labels))], labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _load_name(load: str) -> str:
    return "closed loop" if load == "closed" else f"{float(load) * 100:.0f}% load"


def plot_quality(data: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """One TTFT CDF per family and load (every repeat pooled), as the quality bench drew them."""
    written = []
    for family, fam in data["meta"]["families"].items():
        for load, series in (fam.get("ttft_cdf") or {}).items():
            path = out / f"{stem}-{family}-{load}-ttft-cdf.png"
            draw_cdfs(path, series, f"{family}, {_load_name(load)}: TTFT CDF, all repeats (simulated ms)",
                      "TTFT (ms)")
            written.append(path)
    if written:
        return written
    from bench.quality_report import aggregate

    aggs = aggregate(data["rows"])
    for family, load in dict.fromkeys((a["family"], a["load"]) for a in aggs):
        bars = {a["label"]: {p: a[m][0] * 1000.0 for p, m in (("TTFT p50", "ttft_p50"), ("TTFT p99", "ttft_p99"))
                             if a.get(m)}
                for a in aggs if a["family"] == family and a["load"] == load}
        path = out / f"{stem}-{family}-{load}-ttft.png"
        draw_bars(path, bars, f"{family}, {_load_name(load)}: TTFT, mean over repeats (simulated ms; "
                  "this file holds no CDF)", "TTFT (ms)")
        written.append(path)
    return written


def plot_overhead(rows: list[dict[str, Any]], out: Path, stem: str) -> list[Path]:
    """One end-to-end latency CDF per workload (each route's last repeat), as the overhead bench drew them."""
    written = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        cell = [r for r in rows if r["workload"] == workload]
        if any(r.get("latency_cdf") for r in cell):
            path = out / f"{stem}-{_slug(workload)}-latency-cdf.png"
            draw_cdfs(path, {r["route"]: r.get("latency_cdf") or [] for r in cell},
                      f"{workload}: end-to-end latency CDF (each route's last repeat)", "latency (ms)")
        else:
            path = out / f"{stem}-{_slug(workload)}-cpu.png"
            by_route: dict[str, list[float]] = {}
            for r in cell:
                if r.get("cpu_us_per_req") and not r["route"].startswith("direct"):
                    by_route.setdefault(r["route"], []).append(r["cpu_us_per_req"])
            draw_bars(path, {route: {"CPU us/req (median of repeats)": sorted(v)[len(v) // 2]}
                             for route, v in by_route.items()},
                      f"{workload}: router CPU per request (this file holds no CDF)", "CPU us per request")
        written.append(path)
    return written


def plot_file(result: Path, out: Path) -> list[Path]:
    """Draw every plot RESULT.json supports into out/; SystemExit for a file with nothing to draw."""
    data = json.loads(result.read_text())
    if isinstance(data, dict) and "meta" in data and "rows" in data and "families" in data["meta"]:
        out.mkdir(parents=True, exist_ok=True)
        return plot_quality(data, out, result.stem)
    if isinstance(data, list) and data and all("workload" in r and "route" in r for r in data):
        out.mkdir(parents=True, exist_ok=True)
        return plot_overhead(data, out, result.stem)
    raise SystemExit(f"{result}: not a quality or overhead result; those are the benches that have plots")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a result JSON of `kvroute bench quality` or `overhead`")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for the PNGs (default {DEFAULT_OUT})")


def run(args: argparse.Namespace) -> int:
    for path in plot_file(args.result, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
