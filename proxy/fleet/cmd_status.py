"""`kvroute status`: show the fleet behind a running proxy, once or live (--watch).

Owns the command line and the polling (GET /workers, and GET /fleet when the proxy was
started by `kvroute up`); formatting is render.py's. A CLI, so plain blocking httpx is fine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live

from proxy.fleet.proxyclient import workers_by_id
from proxy.fleet.render import fleet_tables
from proxy.security.tokenfile import token_for


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proxy", default=os.environ.get("KVROUTE_PROXY_URL", "http://127.0.0.1:8000"),
                   help="proxy base URL (env KVROUTE_PROXY_URL; default http://127.0.0.1:8000)")
    p.add_argument("--token", default=os.environ.get("KVROUTE_ADMIN_TOKEN"),
                   help="admin token, when the proxy has one (env KVROUTE_ADMIN_TOKEN)")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--json", action="store_true", help="print the raw /workers and /fleet bodies as JSON")


def unreachable_hint(proxy: str, exc: Exception) -> str:
    """What to say when GET /workers fails: the likely cause and the flag that fixes it."""
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
        return (f"kvroute status: {proxy} wants the admin token: pass --token TOKEN "
                "(or set KVROUTE_ADMIN_TOKEN)")
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return (f"kvroute status: nothing answers at {proxy} ({exc}).\n"
                "  Is the fleet up? `kvroute up` prints its endpoint; point at it with --proxy URL "
                "(or KVROUTE_PROXY_URL), e.g. kvroute status --proxy http://127.0.0.1:8000")
    return f"kvroute status: cannot read {proxy}/workers: {exc}"


def fetch(client: httpx.Client) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    resp = client.get("/workers")
    resp.raise_for_status()
    workers = workers_by_id(resp.json())
    fleet_resp = client.get("/fleet")
    fleet = fleet_resp.json() if fleet_resp.status_code == 200 else None  # a plain `kvroute proxy` has no /fleet
    return workers, fleet


class RateMeter:
    """req/s per worker from the proxy's dispatched_total counter, between two polls."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}

    def update(self, workers: dict[str, dict[str, Any]]) -> dict[str, float]:
        now, rates = time.monotonic(), {}
        for wid, rec in workers.items():
            total = rec.get("dispatched_total")
            if not isinstance(total, int):
                continue
            if wid in self._last and now > self._last[wid][0]:
                t0, n0 = self._last[wid]
                rates[wid] = max(total - n0, 0) / (now - t0)
            self._last[wid] = (now, total)
        return rates


def run(args: argparse.Namespace) -> int:
    token = token_for(args.proxy, args.token)  # --token, KVROUTE_ADMIN_TOKEN, or the file `kvroute up` wrote
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    console = Console(width=None if sys.stdout.isatty() else 160)
    meter = RateMeter()
    with httpx.Client(base_url=args.proxy.rstrip("/"), headers=headers, timeout=5.0) as client:
        try:
            workers, fleet = fetch(client)
        except (httpx.HTTPError, ValueError) as exc:
            print(unreachable_hint(args.proxy, exc), file=sys.stderr)
            return 1
        if args.json:
            import json
            print(json.dumps({"workers": list(workers.values()), "fleet": fleet}, indent=2))
            return 0
        rates = meter.update(workers)
        if not args.watch:
            if fleet and fleet.get("replicas") is not None:
                time.sleep(0.5)  # a second sample gives req/s; cheap for a one-shot command
                workers, fleet = fetch(client)
                rates = meter.update(workers)
            console.print(Group(*fleet_tables(workers, fleet, rates, width=console.width)) if workers or fleet
                          else "no workers")
            return 0
        try:
            tables = fleet_tables(workers, fleet, rates, width=console.width)
            with Live(Group(*tables), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(args.interval)
                    try:
                        workers, fleet = fetch(client)
                    except (httpx.HTTPError, ValueError) as exc:
                        live.update(f"[red]{unreachable_hint(args.proxy, exc)}[/]", refresh=True)
                        continue
                    tables = fleet_tables(workers, fleet, meter.update(workers), width=console.width)
                    live.update(Group(*tables), refresh=True)
        except KeyboardInterrupt:
            return 0
