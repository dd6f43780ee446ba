"""Turning benchmark rows into files: markdown tables, raw JSON, and matplotlib PNG plots.

Owns formatting and file names under bench/results/; it measures nothing.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# The day the run started (UTC): a run that crosses midnight keeps writing the same files.
RUN_DATE = time.strftime("%Y-%m-%d", time.gmtime())


def results_path(name: str, suffix: str, out_dir: Path | None = None) -> Path:
    """bench/results/<YYYY-MM-DD>-<name><suffix>, the date the run started (UTC)."""
    d = out_dir or RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{RUN_DATE}-{name}{suffix}"


def fmt(value: Any, unit: str = "", digits: int = 1, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"
    else:
        text = str(value)
    return text + unit


def ms(seconds: float | None, signed: bool = False, digits: int = 1) -> str:
    return fmt(None if seconds is None else seconds * 1000.0, "", digits, signed)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def environment_note() -> str:
    """One line saying where the numbers come from (commit, whether the code differed from it, CPU count,
    python)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=RESULTS_DIR.parent).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", ":(top)*.py"], capture_output=True, text=True,
                                cwd=RESULTS_DIR.parent).stdout
        changed = [line[3:] for line in status.splitlines() if line.strip()]
        if commit and changed:
            more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
            commit += f" with uncommitted changes to {', '.join(changed[:6])}{more}"
    except OSError:
        commit = "?"
    import os

    return (f"commit {commit or '?'}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def _pyplot():  # type: ignore[no-untyped-def]
    """matplotlib's pyplot (Agg), or None when the `bench` extra is not installed: tables still get written."""
    try:
        import matplotlib
    except ImportError:
        print("[bench] matplotlib missing (pip install 'kvroute[bench]'): no plots", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(path: Path, series: dict[str, Sequence[float]], title: str, xlabel: str) -> bool:
    """One CDF line per label (values in seconds, plotted in ms). False when it could not plot."""
    plt = _pyplot()
    if plt is None:
        return False

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, values in series.items():
        xs = sorted(v * 1000.0 for v in values)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=label, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_spread(path: Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str,
                ylabel: str) -> bool:
    """Lines over time: label -> (t seconds, value). False when it could not plot."""
    plt = _pyplot()
    if plt is None:
        return False

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (ts, vs) in series.items():
        ax.plot(list(ts), list(vs), label=label, linewidth=1.2)
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
