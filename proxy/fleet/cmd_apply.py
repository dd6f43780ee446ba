"""`kvroute apply CONFIG`: send a config file to a running fleet, which reconciles to it.

Owns the command line only: the file is read, interpolated with THIS shell's environment (`${VAR}`)
and checked here (errors with key path and line), then sent to POST /fleet/apply as JSON. The proxy
does not interpolate configs sent over HTTP, so they cannot read its environment back.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import orjson

from proxy.config import ConfigError, parse_config
from proxy.fleet.cmd_scale import post_admin
from proxy.security.tokenfile import token_for


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="fleet config file (YAML)")
    p.add_argument("--proxy", default=os.environ.get("KVROUTE_PROXY_URL", "http://127.0.0.1:8000"),
                   help="proxy base URL (env KVROUTE_PROXY_URL)")
    p.add_argument("--token", default=os.environ.get("KVROUTE_ADMIN_TOKEN"), help="admin token (env KVROUTE_ADMIN_TOKEN)")


def run(args: argparse.Namespace) -> int:
    path = Path(args.config)
    try:
        text = path.read_text()
    except OSError as exc:
        print(f"kvroute apply: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        config = parse_config(text, source=str(path), env=dict(os.environ))
    except ConfigError as exc:
        print(f"kvroute apply: {exc}", file=sys.stderr)
        return 2
    # Only what the file sets (JSON is YAML): the proxy fills in the defaults itself.
    body = orjson.dumps(config.model_dump(mode="json", exclude_unset=True))
    return post_admin(args.proxy, "/fleet/apply", token_for(args.proxy, args.token), content=body,
                      extra_headers={"Content-Type": "application/json"})
