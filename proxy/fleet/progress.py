"""Start-up progress of `kvroute up`: a live rich view on a terminal, one line per state change otherwise.

Owns only what is shown while workers start; it reads the fleet manager and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table

from proxy.fleet.render import STATE_STYLE
from proxy.fleet.supervisor import FAILED, READY


def _settled(manager: Any) -> bool:
    """Everything wanted is ready, or whatever is not ready has given up (waiting longer shows nothing new)."""
    if manager.all_ready():
        return True
    replicas = list(manager.replicas.values())
    return bool(manager.any_failed()) and all(r.state in (READY, FAILED) for r in replicas)


def _view(manager: Any, started: float) -> Group:
    replicas = sorted(manager.replicas.values(), key=lambda r: r.worker_id)
    want = sum(p.replicas for m in manager.desired.models for p in m.pool_list())
    ready = sum(r.ready for r in replicas)
    table = Table(box=None, padding=(0, 2))
    for col in ("worker", "state", "GPUs", "restarts", "note"):
        table.add_column(col)
    for r in replicas:
        style = STATE_STYLE.get(r.state, "")
        table.add_row(r.worker_id, f"[{style}]{r.state}[/]" if style else r.state,
                      ",".join(r.snapshot()["gpus"]) or "-", str(r.restarts), r.last_error or "")
    head = Spinner("dots", text=f"starting workers: {ready}/{want} ready ({time.monotonic() - started:.0f}s)")
    return Group(head, table)


async def show_progress(console: Console, manager: Any, stop: asyncio.Event, timeout_s: float) -> bool:
    """Show progress until the fleet is ready, has settled with failures, `stop` is set, or time runs out.
    Returns whether every wanted worker is ready."""
    started = time.monotonic()
    deadline = started + timeout_s

    async def pause() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)

    if console.is_terminal:
        with Live(_view(manager, started), console=console, refresh_per_second=8, transient=True) as live:
            while not stop.is_set() and not _settled(manager) and time.monotonic() < deadline:
                await pause()
                live.update(_view(manager, started))
        return manager.all_ready()
    seen: dict[str, str] = {}
    while not stop.is_set() and time.monotonic() < deadline:
        for r in list(manager.replicas.values()):
            if seen.get(r.worker_id) != r.state:
                seen[r.worker_id] = r.state
                note = f" ({r.last_error})" if r.state == FAILED and r.last_error else ""
                console.print(f"  {r.worker_id}: {r.state}{note}", highlight=False)
        if _settled(manager):
            break
        await pause()
    return manager.all_ready()
