"""`kvroute proxy`: run the proxy alone, with uvloop, until SIGINT/SIGTERM.

Owns the command line and process lifecycle only; the app is proxy/app.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="address to bind (default: config's proxy.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: config's proxy.port, 8000)")
    p.add_argument("--policy", default=None, help="routing policy (default: config's proxy.policy, kv_aware)")
    p.add_argument("--config", default=None, help="fleet config file (YAML); without it defaults apply")
    p.add_argument("--state", default=None, help="'memory' (default) or redis://host:port/db")
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="client API keys for /v1/* (one per line, or a YAML list); replaces proxy.api_keys")
    p.add_argument("--insecure-open-control-plane", action="store_true",
                   help="serve /workers, /nodes and /fleet to anyone off loopback without an admin token (unsafe)")


def run(args: argparse.Namespace) -> int:
    from proxy.config import ConfigError, FleetConfig, load_config
    from proxy.routing.base import policy_names

    try:
        config = load_config(args.config) if args.config else FleetConfig()
        if args.host:
            config.proxy.host = args.host
        if args.port is not None:
            config.proxy.port = args.port
        if args.log_level:
            config.proxy.log_level = args.log_level
        if args.state:
            config.state.url = args.state
        if args.api_keys:
            config.proxy.api_keys = args.api_keys
        from proxy.security.limits import return_large_frees_to_the_os

        return_large_frees_to_the_os()  # large request bodies go back to the OS once served
        _apply_security_flags(config, args)
    except (ConfigError, ValueError) as exc:
        print(f"kvroute proxy: {exc}", file=sys.stderr)
        return 2
    from proxy.security.controlauth import startup_problem

    may_start, message = startup_problem(config.proxy.host, config.proxy.admin_token,
                                         config.proxy.insecure_open_control_plane)
    if message:
        print(f"kvroute proxy: {message}", file=sys.stderr, flush=True)
    if not may_start:
        return 2
    from proxy.security.tokenfile import ensure_admin_token

    if (path := ensure_admin_token(config.proxy)) is not None:
        print(f"kvroute proxy: administering needs the admin token in {path} (`kvroute status`, `scale` and "
              "`apply` on this machine read it)", file=sys.stderr, flush=True)
    if args.policy and args.policy not in policy_names():
        print(f"kvroute proxy: unknown policy '{args.policy}'; known: {', '.join(policy_names())}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.proxy.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; a plain loop still works
        uvloop = None
    runner = uvloop.run if uvloop is not None else asyncio.run
    try:
        runner(_main(config, args.policy))
    except ValueError as exc:
        print(f"kvroute proxy: {exc}", file=sys.stderr)
        return 2
    return 0


def _apply_security_flags(config, args: argparse.Namespace) -> None:
    """--insecure-open-control-plane, and the tokens from the environment when the config has none."""
    from proxy.security.controlauth import ADMIN_TOKEN_ENV, WORKER_TOKEN_ENV, token_or_none

    if getattr(args, "insecure_open_control_plane", False):
        config.proxy.insecure_open_control_plane = True
    if config.proxy.admin_token is None:
        config.proxy.admin_token = token_or_none(os.environ.get(ADMIN_TOKEN_ENV))
    if config.proxy.worker_token is None:
        config.proxy.worker_token = token_or_none(os.environ.get(WORKER_TOKEN_ENV))


async def _main(config, policy: str | None) -> None:
    from proxy.app import build_app, serve

    app = build_app(config, policy=policy)
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await serve(app, config.proxy.host, config.proxy.port)
    except asyncio.CancelledError:
        logging.getLogger("kvroute.proxy").info("shutting down")
