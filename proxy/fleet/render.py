"""Rich tables of a fleet: one per model, one row per worker, for `kvroute up` and `kvroute status`.

Owns joining the proxy's registry view (GET /workers) with the fleet manager's (GET /fleet),
choosing the columns that fit the terminal's width, and formatting; it does no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from proxy.observability.worker_states import explain_state

STATE_STYLE = {"ready": "green", "starting": "yellow", "pending": "yellow", "backoff": "yellow",
               "stale": "yellow", "draining": "cyan", "failed": "bold red", "unhealthy": "red", "stopped": "dim"}
# The fleet manager says "starting" for anything the proxy does not call ready; once the proxy knows the
# worker, its own state (stale, unhealthy, draining) is the truth, with its reason.
_PROXY_DECIDES = ("starting", "ready")


def _uptime(since: float | None, now: float) -> str:
    if not since:
        return "-"
    s = int(max(now - since, 0))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _pct(x: Any) -> str:
    return f"{100 * float(x):.0f}%" if isinstance(x, int | float) else "-"


def _host(url: str | None) -> str:
    if not url:
        return "-"
    parts = urlsplit(url)
    return (parts.hostname or url) + (f":{parts.port}" if parts.port else "")


def merge_rows(workers: dict[str, dict[str, Any]], fleet: dict[str, Any] | None,
               rates: dict[str, float] | None = None) -> dict[str, list[dict[str, Any]]]:
    """{model: [row, ...]} from the registry records and the fleet manager's replicas (either may miss a worker)."""
    rates = rates or {}
    rows: dict[str, list[dict[str, Any]]] = {}
    seen: set[str] = set()
    for rep in (fleet or {}).get("replicas", []):
        wid = rep["worker_id"]
        seen.add(wid)
        rec = workers.get(wid, {})
        state, reason = rep["state"], rep.get("last_error") or ""
        registered = rep.get("registered_state", rec.get("state"))
        if state in _PROXY_DECIDES and registered and rec.get("state"):
            state, reason = rec["state"], explain_state(rec)
        elif state == "starting" and not reason:
            reason = "engine starting, not registered yet"
        rows.setdefault(rep["model"], []).append(_row(wid, state, reason, rec, rates.get(wid, rep.get("req_per_s")),
                                                      rep.get("gpus") or [], rep.get("started_at"),
                                                      rep.get("engine"), rep.get("url"), rep.get("restarts", 0),
                                                      rep.get("role")))
    for wid, rec in workers.items():
        if wid in seen:
            continue
        model = (rec.get("models") or ["?"])[0]
        rows.setdefault(model, []).append(_row(wid, rec.get("state", "?"), explain_state(rec), rec, rates.get(wid),
                                               [], rec.get("registered_at"), None, None, None))
    return rows


def _row(wid: str, state: str, reason: str, rec: dict[str, Any], rate: float | None, gpus: list[str],
         since: float | None, engine: str | None, url: str | None, restarts: int | None,
         role: str | None = None) -> dict[str, Any]:
    report = rec.get("last_report") or {}
    configured = engine or rec.get("engine") or "-"
    running = report.get("engine") or configured
    return {"worker_id": wid, "state": state, "reason": reason, "role": role or rec.get("role") or "both",
            "engine": configured if running in (configured, "unknown") else f"{configured}>{running}",
            "url": rec.get("url") or url or "-", "host": _host(rec.get("url") or url), "gpus": ",".join(gpus) or "-",
            "kv": report.get("kv_cache_usage", rec.get("projected_kv_usage")),
            "running": report.get("num_running", rec.get("in_flight")), "waiting": report.get("num_waiting"),
            "rate": rate, "since": since, "restarts": restarts}


@dataclass(frozen=True)
class _Column:
    key: str
    header: str
    right: bool = False
    drop_rank: int | None = None  # lower drops first when the terminal is narrow; None: always shown


# Display order. The reason shrinks before anything is dropped, and goes last.
_COLUMNS = (
    _Column("worker", "worker"), _Column("state", "state"), _Column("role", "role", drop_rank=7),
    _Column("engine", "engine", drop_rank=1),
    _Column("host", "host", drop_rank=3), _Column("gpus", "GPUs", drop_rank=2), _Column("kv", "KV", True),
    _Column("running", "run", True), _Column("waiting", "wait", True, drop_rank=6),
    _Column("rate", "req/s", True, drop_rank=4), _Column("uptime", "up", True, drop_rank=5),
    _Column("restarts", "restarts", True, drop_rank=0), _Column("reason", "reason"),
)
_REASON_MIN = 24  # below this the reason is dropped rather than cut to nothing


def _cells(r: dict[str, Any], now: float) -> dict[str, str]:
    return {"worker": r["worker_id"], "state": r["state"], "role": r["role"], "engine": r["engine"], "host": r["host"],
            "gpus": r["gpus"], "kv": _pct(r["kv"]),
            "running": str(r["running"]) if r["running"] is not None else "-",
            "waiting": str(r["waiting"]) if r["waiting"] is not None else "-",
            "rate": f"{r['rate']:.1f}" if isinstance(r["rate"], int | float) else "-",
            "uptime": _uptime(r["since"], now), "restarts": str(r["restarts"]) if r["restarts"] is not None else "-",
            "reason": r["reason"] or ""}


def fit_columns(natural: dict[str, int], width: int | None) -> dict[str, int]:
    """{column key: width} for the columns that fit in `width` (None: all, at their natural width).

    Columns are separated by 2 spaces. The reason column shrinks first (to _REASON_MIN), then columns
    drop in drop_rank order, then the reason goes too; worker, state, KV and run always stay.
    """
    widths = {c.key: natural[c.key] for c in _COLUMNS if c.key in natural}  # a column left out is not shown
    if width is None:
        return widths

    def total() -> int:
        return sum(widths.values()) + 2 * (len(widths) - 1)

    def shrink_reason(floor: int) -> None:
        if "reason" in widths and total() > width:
            widths["reason"] = max(floor, widths["reason"] - (total() - width))

    shrink_reason(_REASON_MIN)
    for col in sorted((c for c in _COLUMNS if c.drop_rank is not None and c.key in widths),
                      key=lambda c: c.drop_rank or 0):
        if total() <= width:
            break
        del widths[col.key]
        shrink_reason(_REASON_MIN)
        if "reason" in widths and total() <= width:
            widths["reason"] = min(natural["reason"], widths["reason"] + width - total())  # give room back
    if total() > width and "reason" in widths:
        del widths["reason"]
    return widths


def fleet_tables(workers: dict[str, dict[str, Any]], fleet: dict[str, Any] | None,
                 rates: dict[str, float] | None = None, now: float | None = None,
                 width: int | None = None) -> list[RenderableType]:
    """One table per model, fitted to `width` columns (None: every column); then fleet-wide notes."""
    now = time.time() if now is None else now
    desired = {m["name"]: m for m in (fleet or {}).get("models", [])}
    rows = merge_rows(workers, fleet, rates)
    out: list[RenderableType] = []
    for model in sorted(set(rows) | set(desired)):
        d = desired.get(model)
        model_rows = sorted(rows.get(model, []), key=lambda r: r["worker_id"])
        ready = sum(r["state"] == "ready" for r in model_rows)
        title = Text.assemble((model, "bold"), f"  {ready}/{d['desired_replicas'] if d else len(model_rows)} ready")
        if d:
            title.append(f"  ({d['engine']}, placement {d['placement']})")
        pools = (d or {}).get("pools") or []
        if pools:  # a disaggregated model: each pool's ready / desired
            title.append("  " + ", ".join(f"{p['role']} {p['ready']}/{p['desired_replicas']}" for p in pools))
        cells = [_cells(r, now) for r in model_rows]
        natural = {c.key: max([len(c.header)] + [len(row[c.key]) for row in cells]) for c in _COLUMNS}
        if not any(row["reason"] for row in cells):
            natural["reason"] = 0
        if all(r["role"] == "both" for r in model_rows):
            del natural["role"]  # an aggregated model: no role column
        widths = fit_columns(natural, width)
        if not natural["reason"]:
            widths.pop("reason", None)
        shown = [c for c in _COLUMNS if c.key in widths]
        out.append(title)  # above the table, not its title: a title wraps at the table's (narrow) width
        t = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
        for c in shown:
            t.add_column(c.header, justify="right" if c.right else "left", no_wrap=True, overflow="ellipsis",
                         width=widths[c.key])
        for r, row in zip(model_rows, cells, strict=True):
            style = STATE_STYLE.get(r["state"], "")
            values: list[RenderableType] = []
            for c in shown:
                value = row[c.key]
                values.append(Text(value, style=style) if c.key == "state" else Text(value))
            t.add_row(*values)
        out.append(t)
    error = (fleet or {}).get("last_error")
    if error:
        out.append(Text(f"fleet: {error}", style="red"))
    return out
