"""Turning benchmark rows into files: markdown tables, raw JSON, and the distributions plots are drawn from.

Owns formatting and file names under bench/results/; it measures nothing and draws nothing (no PNG is
written by a bench: `kvroute bench plot RESULT.json` draws from the CDFs kept in the JSON, bench/plot.py).
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
    """Compact JSON (the result files stay small; the markdown beside it is the readable form)."""
    path.write_text(json.dumps(data, separators=(",", ":"), default=str))


# Where a CDF is sampled: every 2% up to p90, every 1% to p99, then the far tail. 58 points draw the
# curve on a log axis as well as the raw samples did, in ~0.5 KB instead of one number per request.
CDF_QUANTILES = (*(i / 50 for i in range(46)), *(i / 100 for i in range(91, 100)), 0.995, 0.999, 1.0)


def cdf(values: Sequence[float]) -> list[float]:
    """values (seconds) at CDF_QUANTILES (nearest rank), to the microsecond; [] for no values."""
    xs = sorted(values)
    if not xs:
        return []
    return [round(xs[min(len(xs) - 1, round(q * (len(xs) - 1)))], 6) for q in CDF_QUANTILES]
