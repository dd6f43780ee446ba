"""A client that runs on another host: sends chat requests to a proxy until a stop file appears, then writes
what happened (per-worker counts, failures) as JSON. Owns nothing else.

    python -m tests.multihost.client URL --stop FILE --out FILE [--concurrency N] [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import Counter

import httpx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--stop", required=True, help="stop once this file exists")
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--model", default="tiny")
    args = p.parse_args()
    served: Counter[str] = Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        n = 0
        with httpx.Client(timeout=60) as client:
            while not os.path.exists(args.stop):
                n += 1
                body = {"model": args.model, "max_tokens": 8,
                        "messages": [{"role": "user", "content": f"client {i} request {n}"}]}
                try:
                    r = client.post(f"{args.url}/v1/chat/completions", json=body)
                    worker = r.headers.get("x-kvroute-worker", "?") if r.status_code == 200 else None
                    error = None if worker else f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    worker, error = None, f"{type(exc).__name__}: {exc}"
                with lock:
                    if error:
                        failures.append(error)
                    else:
                        served[worker or "?"] += 1
                    progress = {"served": dict(served), "failures": failures[-20:], "failed": len(failures),
                                "at": time.time()}
                if n % 5 == 0:
                    with lock:
                        _write(args.out + ".progress", progress)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _write(args.out, {"served": dict(served), "failures": failures[-20:], "failed": len(failures)})


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
