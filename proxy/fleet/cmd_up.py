"""`kvroute up [CONFIG]`: the proxy (in this process) plus every worker the config asks for, kept equal
to the file until Ctrl-C / SIGTERM, which drains and stops everything.

Owns the command line, start-up order, live progress and shutdown; the fleet logic is in
reconcile.py, the proxy in proxy/app.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import logging.handlers
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy.config import ConfigError, FleetConfig, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default="config.yaml", help="fleet config file (default ./config.yaml)")
    p.add_argument("--host", default=None, help="proxy address to bind (default: proxy.host of the config)")
    p.add_argument("--port", type=int, default=None, help="proxy port (default: proxy.port; 0 = a free port)")
    p.add_argument("--policy", default=None, help="routing policy (default: proxy.policy of the config)")
    p.add_argument("--advertise-url", default=None,
                   help="proxy URL that workers on other machines (placement ray) dial; default from the bind address")
    p.add_argument("--run-dir", default=os.environ.get("KVROUTE_RUN_DIR"),
                   help="where the logs go: kvroute-up.log and one file per worker (env KVROUTE_RUN_DIR; "
                        "default .kvroute/logs/ next to the config file)")
    p.add_argument("--no-watch", action="store_true", help="do not follow edits of the config file")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="client API keys for /v1/* (one per line, or a YAML list); replaces proxy.api_keys")
    p.add_argument("--insecure-open-control-plane", action="store_true",
                   help="off loopback without proxy.admin_token, serve the control plane to everyone instead of "
                        "generating a token (unsafe: anyone can start processes here)")
    p.add_argument("--ready-timeout-s", type=float, default=None,
                   help="how long to show start-up progress before printing the status anyway "
                        "(default: the longest startup_timeout_s of the models)")
    sup = p.add_argument_group("supervision")
    sup.add_argument("--restart-backoff-s", type=float, default=1.0, help="first restart delay after a crash (doubles)")
    sup.add_argument("--crash-loop-count", type=int, default=5, help="crashes within the window that mark a worker failed")
    sup.add_argument("--crash-loop-window-s", type=float, default=120.0)


def run(args: argparse.Namespace) -> int:
    path = Path(args.config)
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 2
    if args.host is not None or args.port is not None:
        update: dict[str, Any] = {}
        if args.host is not None:
            update["host"] = args.host
        if args.port is not None:
            update["port"] = args.port
        config = config.model_copy(update={"proxy": config.proxy.model_copy(update=update)})
    if args.api_keys:
        config.proxy.api_keys = args.api_keys
    from proxy.security.limits import return_large_frees_to_the_os

    return_large_frees_to_the_os()  # large request bodies go back to the OS once served
    from proxy.cmd_proxy import _apply_security_flags

    _apply_security_flags(config, args)
    args.run_dir = str(_log_dir(args.run_dir, path))
    _log_to_file(config.proxy.log_level, Path(args.run_dir))
    import uvloop

    return uvloop.run(_up(args, path, config))


LOG_FILE = "kvroute-up.log"
ROTATE_BYTES = 20 * 2**20  # a log past this size is moved to NAME.1 at the next start


def _log_dir(given: str | None, config_path: Path) -> Path:
    """--run-dir / KVROUTE_RUN_DIR, else .kvroute/logs/ next to the config (reused by every start);
    ~/.kvroute/logs/ when the config's folder is not writable."""
    if given:
        folder = Path(given)
        folder.mkdir(parents=True, exist_ok=True)
        return folder.resolve()
    for folder in (config_path.resolve().parent / ".kvroute" / "logs", Path.home() / ".kvroute" / "logs"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise SystemExit(f"kvroute up: no writable log folder; pass --run-dir DIR (tried {config_path.parent}/.kvroute)")


def _log_to_file(level: str, folder: Path) -> None:
    """Everything to folder/kvroute-up.log; only warnings and errors also reach the terminal, so the progress
    view and a log line never say the same thing twice. Worker logs from an earlier start are rotated once big."""
    for old in folder.glob("*.log"):
        if old.name != LOG_FILE and old.stat().st_size > ROTATE_BYTES:
            old.replace(old.with_name(old.name + ".1"))
    file_handler = logging.handlers.RotatingFileHandler(folder / LOG_FILE, maxBytes=ROTATE_BYTES, backupCount=2)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(logging.WARNING)
    terminal.setFormatter(logging.Formatter("kvroute up: %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    root.addHandler(file_handler)
    root.addHandler(terminal)


def _cli() -> str:
    """How to call this CLI from the current folder: `kvroute` when it is on PATH, else its path in the venv."""
    here = Path(sys.executable).parent / "kvroute"
    found = shutil.which("kvroute")
    if found and here.exists() and Path(found).resolve() == here.resolve():
        return "kvroute"
    return _short_path(here) if here.exists() else f"{sys.executable} -m proxy.cli"


def _status_hint(proxy_url: str, width: int) -> str:
    """The `status:` line; split with a shell line continuation when a long venv path would wrap it mid-URL."""
    line = f"status:    {_cli()} status --proxy {proxy_url}"
    if len(line) <= width:
        return line
    head, tail = line.split(" --proxy ", 1)
    return f"{head} \\\n           --proxy {tail}"


def _short_path(path: Path) -> str:
    """Relative to the current folder when it is below it (.venv/bin/kvroute), else absolute."""
    rel = os.path.relpath(path)
    return str(path.resolve()) if rel.startswith("..") else rel


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _up(args: argparse.Namespace, path: Path, config: FleetConfig) -> int:
    from rich.console import Console

    from proxy.fleet.gpus import GpuAssignmentError, GpuPool, detect_gpus
    from proxy.fleet.proxyclient import ProxyControl
    from proxy.fleet.reconcile import FleetManager
    from proxy.fleet.supervisor import RestartPolicy

    # Piped output (logs, tests) gets full-width tables instead of rich's 80-column default.
    console = Console(width=None if sys.stdout.isatty() else 160)
    gpus, source = await detect_gpus(os.environ)
    pool = GpuPool(gpus, source)
    policy = RestartPolicy(backoff_s=args.restart_backoff_s, crash_loop_count=args.crash_loop_count,
                           crash_loop_window_s=args.crash_loop_window_s)
    host = config.proxy.host
    dial_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    port = config.proxy.port or _free_port(dial_host)
    config = config.model_copy(update={"proxy": config.proxy.model_copy(update={"port": port})})
    config = _secure(config, console)
    proxy_url = f"http://{dial_host}:{port}"
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="kvroute-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)

    # Workers on other nodes (placement ray) cannot dial 127.0.0.1: without --advertise-url they get
    # the driver node's address when the proxy binds all interfaces.
    remote_proxy_url = args.advertise_url or (None if dial_host != host else proxy_url)
    placements = _Placements(config, run_dir, remote_proxy_url, port)
    control = ProxyControl(proxy_url, config.proxy.admin_token)
    manager = FleetManager(config, proxy_url=proxy_url, control=control, placements=placements.get, gpus=pool,
                           restart_policy=policy, log_level=config.proxy.log_level)
    try:
        manager.check(config)
    except GpuAssignmentError as exc:
        print(f"kvroute up: the fleet does not fit: {exc}", file=sys.stderr)
        return 2

    from proxy.fleet.proxyhost import start_proxy

    try:
        stop_proxy = await start_proxy(config, manager, host, port, policy=args.policy)
    except (OSError, ValueError, RuntimeError) as exc:  # port taken, unknown policy, ...
        print(f"kvroute up: cannot start the proxy on {host}:{port}: {exc}", file=sys.stderr)
        await control.close()
        return 1
    console.print(f"kvroute up: proxy on {proxy_url} (GPUs: {', '.join(gpus) or 'none'} from {source}); "
                  f"logs in {run_dir}/")

    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    watcher = None
    manager.config_path = path  # `kvroute scale` writes the new count back here (proxy/fleet/scalefile.py)
    manager.start()
    if not args.no_watch:
        from proxy.fleet.config_watch import ConfigWatcher

        # A rejected edit shows in `kvroute status` (GET /fleet's last_error) until a later edit applies.
        watcher = ConfigWatcher(path, manager.apply, initial_text=await asyncio.to_thread(path.read_text),
                                on_rejected=lambda why: setattr(manager, "last_error", why))
        manager.config_rewritten = watcher.file_rewritten
        watcher.start()
    try:
        timeout = args.ready_timeout_s or max([m.startup_timeout_s for m in config.models] or [60.0])
        from proxy.fleet.progress import show_progress

        ready = await show_progress(console, manager, stop, timeout)
        if not stop.is_set():
            await _print_status(console, manager, proxy_url, ready, run_dir)
            await stop.wait()
    finally:
        console.print("kvroute up: draining and stopping every worker (Ctrl-C again to kill at once)")
        if watcher is not None:
            await watcher.stop()
        # New requests get 503 shutting_down at once; those in flight finish before the workers go.
        draining = asyncio.create_task(stop_proxy.drain(manager.desired.proxy.drain_grace_s))
        forced_early = asyncio.create_task(force.wait())
        await asyncio.wait({draining, forced_early}, return_when=asyncio.FIRST_COMPLETED)
        for task in (draining, forced_early):
            task.cancel()
        shutdown = asyncio.create_task(manager.shutdown(drain=True))
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({shutdown, forced}, return_when=asyncio.FIRST_COMPLETED)
        if not shutdown.done():
            await manager.kill_all()
            shutdown.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await shutdown
        forced.cancel()
        await placements.close()
        await control.close()
        await stop_proxy()
        console.print("kvroute up: stopped")
    return 0


def _secure(config: FleetConfig, console: Any) -> FleetConfig:
    """Without an admin token, make one (kept in a 0600 file that `kvroute status/scale/apply` and the
    dashboard's admin read), on loopback too, unless --insecure-open-control-plane; and give the workers a
    token of their own, not the admin's."""
    from proxy.security.controlauth import new_secret, startup_problem
    from proxy.security.tokenfile import generate_admin_token

    proxy = config.proxy
    update: dict[str, Any] = {}
    _, warning = startup_problem(proxy.host, proxy.admin_token, proxy.insecure_open_control_plane)
    if warning and proxy.insecure_open_control_plane:
        print(f"kvroute up: {warning}", file=sys.stderr, flush=True)
    elif not proxy.admin_token and not proxy.insecure_open_control_plane:
        token, path = generate_admin_token(proxy.port)
        update["admin_token"] = token
        console.print(f"kvroute up: administering needs the admin token in {path} "
                      "(`kvroute status`, `scale` and `apply` on this machine read it)")
    if (proxy.admin_token or update.get("admin_token")) and not proxy.worker_token:
        update["worker_token"] = new_secret()  # workers can register themselves, and administer nothing
    return config.model_copy(update={"proxy": proxy.model_copy(update=update)}) if update else config


async def _print_status(console: Any, manager: Any, proxy_url: str, ready: bool, run_dir: Path) -> None:
    from rich.console import Group

    from proxy.fleet.render import fleet_tables

    try:
        workers = await manager.control.workers()
    except Exception:
        workers = {}
    if ready:
        console.print(f"[bold green]ready[/]: OpenAI endpoint {proxy_url}/v1")
    else:
        failed = ", ".join(r.worker_id for r in manager.any_failed())
        console.print(f"[bold yellow]not every worker is ready[/] ({'failed: ' + failed if failed else 'still starting'});"
                      f" endpoint {proxy_url}/v1; see `kvroute status --proxy {proxy_url}`")
    console.print(Group(*fleet_tables(workers, manager.snapshot(), now=time.time(), width=console.width)))
    console.print(f"dashboard: {proxy_url}/dashboard\n"
                  f"{_status_hint(proxy_url, console.width)}\n"
                  f"logs:      {_short_path(run_dir)}/ ({LOG_FILE}, one file per worker)\n"
                  f"stop:      Ctrl-C here (drains every worker first), or kill -INT {os.getpid()}",
                  highlight=False)


class _Placements:
    """Creates each placement on first use, so a local-only fleet never imports Ray."""

    def __init__(self, config: FleetConfig, run_dir: Path, remote_proxy_url: str | None, proxy_port: int) -> None:
        self.config = config
        self.run_dir = run_dir
        self.remote_proxy_url = remote_proxy_url
        self.proxy_port = proxy_port
        self._made: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self._made:
            if name == "local":
                from proxy.fleet.placement.local import LocalPlacement

                self._made[name] = LocalPlacement(self.run_dir)
            elif name == "ray":
                from proxy.fleet.placement.ray import RayPlacement

                state = self.config.state
                self._made[name] = RayPlacement(state.ray_address or "auto", self.remote_proxy_url, self.proxy_port,
                                                state.ray_gpu_resource, str(self.run_dir))
            else:
                raise ValueError(f"unknown placement {name}")
        return self._made[name]

    async def close(self) -> None:
        for p in self._made.values():
            with contextlib.suppress(Exception):
                await p.close()
