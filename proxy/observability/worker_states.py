"""Why a worker is in the state it is in, in words an operator can act on.

Owns only the explanation; the states themselves and their transitions are proxy/workers/registry.py's.
Works on the JSON record GET /workers returns, so `kvroute status` and the dashboard agree.
"""

from __future__ import annotations

from typing import Any


def explain_state(record: dict[str, Any]) -> str:
    """A short reason for `record["state"]` (a Worker.to_json() record); "" for a plain ready worker."""
    state = record.get("state")
    report = record.get("last_report") or {}
    reported = report.get("state")
    error = record.get("last_error")
    age = record.get("reading_age_s")
    if state == "draining":
        return "the worker is draining" if reported == "draining" else "drain requested"
    if state == "unhealthy":
        if record.get("breaker_open"):
            return f"circuit open after failures{_tail(error)}"
        if reported == "failed":
            return "the worker reports its engine failed"
        if error and "probe" in str(error):
            return str(error)[:100]  # the monitor's own words already say it was the probe
        return f"health probe failed{_tail(error)}"
    if state == "stale":
        if reported == "starting":
            return "the worker reports its engine is starting"
        if age is None:
            return "no load report yet"
        return f"last load report {age:.0f}s ago"
    return ""


def _tail(error: Any) -> str:
    return f": {str(error)[:80]}" if error else ""
