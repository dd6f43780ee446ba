"""`kvroute scale MODEL N [--role ROLE]`: set one model's replica count (or one pool's) through a running
proxy's admin API.

Owns the command line only; the fleet manager inside `kvroute up` does the work (POST /fleet/scale).
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from proxy.security.tokenfile import token_for


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model name or alias")
    p.add_argument("replicas", type=int, help="number of replicas wanted (0 drains them all)")
    p.add_argument("--role", choices=["both", "prefill", "decode", "encode"], default=None,
                   help="scale this pool of a model with pools (prefill, decode, encode, both)")
    p.add_argument("--proxy", default=os.environ.get("KVROUTE_PROXY_URL", "http://127.0.0.1:8000"),
                   help="proxy base URL (env KVROUTE_PROXY_URL)")
    p.add_argument("--token", default=os.environ.get("KVROUTE_ADMIN_TOKEN"), help="admin token (env KVROUTE_ADMIN_TOKEN)")


def post_admin(proxy: str, path: str, token: str | None, extra_headers: dict[str, str] | None = None,
               **kwargs: object) -> int:
    """POST to the fleet admin API and print the plan or the error; the command's exit code."""
    headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **(extra_headers or {})}
    try:
        resp = httpx.post(proxy.rstrip("/") + path, headers=headers, timeout=30.0, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as exc:
        print(f"kvroute: cannot reach {proxy}: {exc}", file=sys.stderr)
        return 1
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"message": resp.text}}
    if resp.status_code == 404 and "error" not in body:
        print(f"kvroute: {proxy} has no fleet API (was it started with `kvroute up`?)", file=sys.stderr)
        return 1
    if resp.status_code >= 400:
        print(f"kvroute: {body.get('error', {}).get('message', resp.text)}", file=sys.stderr)
        return 1
    for model, action in (body.get("plan") or {}).items():
        print(f"{model}: {action}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.replicas < 0:
        print("kvroute scale: replicas must be >= 0", file=sys.stderr)
        return 2
    return post_admin(args.proxy, "/fleet/scale", token_for(args.proxy, args.token),
                      json={"model": args.model, "replicas": args.replicas,
                            **({"role": args.role} if args.role else {})})
