"""Rich tables of a fleet: one per model, one row per worker, for `kvroute up` and `kvroute status`.

Owns joining the proxy's registry view (GET /workers) with the fleet manager's (GET /fleet)
and formatting; it does no I/O.
"""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

STATE_STYLE = {"ready": "green", "starting": "yellow", "pending": "yellow", "backoff": "yellow",
               "stale": "yellow", "draining": "cyan", "failed": "bold red", "unhealthy": "red", "stopped": "dim"}


def _uptime(since: float | None, now: float) -> str:
    if not since:
        return "-"
    s = int(max(now - since, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _pct(x: Any) -> str:
    return f"{100 * float(x):.0f}%" if isinstance(x, int | float) else "-"


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
        state = rep["state"]
        if state == "ready" and rec.get("state"):
            state = rec["state"]  # the proxy's view is finer: stale, unhealthy, draining
        rows.setdefault(rep["model"], []).append(_row(wid, state, rec, rates.get(wid, rep.get("req_per_s")),
                                                      rep.get("gpus") or [], rep.get("started_at"),
                                                      rep.get("engine"), rep.get("url"), rep.get("restarts", 0),
                                                      rep.get("last_error")))
    for wid, rec in workers.items():
        if wid in seen:
            continue
        model = (rec.get("models") or ["?"])[0]
        rows.setdefault(model, []).append(_row(wid, rec.get("state", "?"), rec, rates.get(wid), [],
                                               rec.get("registered_at"), None, None, None, None))
    return rows


def _row(wid: str, state: str, rec: dict[str, Any], rate: float | None, gpus: list[str], since: float | None,
         engine: str | None, url: str | None, restarts: int | None, error: str | None) -> dict[str, Any]:
    report = rec.get("last_report") or {}
    return {"worker_id": wid, "state": state, "engine": report.get("engine") or rec.get("engine") or engine or "-",
            "url": rec.get("url") or url or "-", "gpus": ",".join(gpus) or "-",
            "kv": report.get("kv_cache_usage", rec.get("projected_kv_usage")),
            "running": report.get("num_running", rec.get("in_flight")), "waiting": report.get("num_waiting"),
            "rate": rate, "since": since, "restarts": restarts, "error": error}


def fleet_tables(workers: dict[str, dict[str, Any]], fleet: dict[str, Any] | None,
                 rates: dict[str, float] | None = None, now: float | None = None) -> list[Table]:
    now = time.time() if now is None else now
    desired = {m["name"]: m for m in (fleet or {}).get("models", [])}
    rows = merge_rows(workers, fleet, rates)
    tables = []
    for model in sorted(set(rows) | set(desired)):
        d = desired.get(model)
        model_rows = sorted(rows.get(model, []), key=lambda r: r["worker_id"])
        ready = sum(r["state"] == "ready" for r in model_rows)
        title = f"[bold]{model}[/]  {ready}/{d['desired_replicas'] if d else len(model_rows)} ready"
        if d:
            title += f"  ({d['engine']}, placement {d['placement']})"
        t = Table(title=title, title_justify="left", expand=False)
        id_width = max([len(r["worker_id"]) for r in model_rows] or [6])
        for col in ("worker", "state", "engine", "url", "GPUs", "KV", "running", "waiting", "req/s", "uptime",
                    "restarts"):
            # On a narrow terminal the numbers shrink; the worker id and state stay whole.
            t.add_column(col, justify="right" if col in ("KV", "running", "waiting", "req/s", "restarts") else "left",
                         no_wrap=col in ("worker", "state"),
                         min_width=id_width if col == "worker" else (8 if col == "state" else None))
        for r in model_rows:
            style = STATE_STYLE.get(r["state"], "")
            state = f"[{style}]{r['state']}[/]" if style else r["state"]
            rate = f"{r['rate']:.1f}" if isinstance(r["rate"], int | float) else "-"
            t.add_row(r["worker_id"], state, r["engine"], r["url"], r["gpus"], _pct(r["kv"]),
                      str(r["running"]) if r["running"] is not None else "-",
                      str(r["waiting"]) if r["waiting"] is not None else "-", rate, _uptime(r["since"], now),
                      str(r["restarts"]) if r["restarts"] is not None else "-")
        tables.append(t)
    return tables
