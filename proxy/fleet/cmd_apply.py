"""`kvroute apply CONFIG`: send a config file to a running fleet, which reconciles to it.

Owns the command line only: the file is checked here first (errors with key path and line),
then its text goes to POST /fleet/apply, where `${VAR}`s take the values of `kvroute up`'s environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from proxy.config import ConfigError, parse_config
from proxy.fleet.cmd_scale import post_admin


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
    # Variables may be set only where `kvroute up` runs, so a missing one is not an error here.
    env = {**os.environ}
    try:
        parse_config(text, source=str(path), env=env)
    except ConfigError as exc:
        if not all("environment variable" in p for p in exc.problems):
            print(f"kvroute apply: {exc}", file=sys.stderr)
            return 2
    return post_admin(args.proxy, "/fleet/apply", args.token, content=text.encode(),
                      extra_headers={"Content-Type": "application/yaml"})
