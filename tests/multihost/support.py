"""What the multi-host tests share: a proxy config open to the test network, starting proxies and sim
workers on hosts, reading the proxy's view, and a client load that timestamps every request.

Owns these helpers only; the hosts come from tests/support/netns.py.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.netns import SUBNET_PREFIX, Host
from tests.support.procs import Proc, wait_until

ADMIN_TOKEN = "multihost-admin-token"
WORKER_TOKEN = "multihost-worker-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROXY_PORT = 8000  # each host has its own port space: fixed ports never collide
WORKER_PORT = 8101
MODEL = "tiny"
NETWORK = SUBNET_PREFIX + "0/24"


def proxy_config(tmp_path: Path, name: str = "proxy.yaml", state: str = "memory", extra: str = "") -> Path:
    """A proxy config for the test network: control plane behind tokens, workers allowed on 10.203.0.0/24."""
    path = tmp_path / name
    path.write_text(f"""
proxy:
  admin_token: {ADMIN_TOKEN}
  worker_token: {WORKER_TOKEN}
  worker_networks: ["{NETWORK}", "127.0.0.0/8"]
  trusted_worker_networks: []
  drain_grace_s: 5
{extra}
state:
  url: "{state}"
models: []
""")
    return path


def start_proxy(host: Host, config: Path, name: str = "proxy", *extra: str) -> Proc:
    proc = host.kvroute("proxy", "--config", str(config), "--host", "0.0.0.0", "--port", str(PROXY_PORT),
                        *extra, name=name)
    wait_until(lambda: proc.alive() and httpx.get(f"{host.url(PROXY_PORT)}/health", timeout=1).status_code == 200
               or not proc.alive(), 60, 0.1, f"the proxy on {host.name} to answer")
    assert proc.alive(), proc.log()[-3000:]
    return proc


def start_sim(host: Host, proxies: list[Host], worker_id: str, *extra: str, port: int = WORKER_PORT,
              time_scale: float = 20.0) -> Proc:
    """A sim worker bound to 0.0.0.0 on `host`, registering with every proxy in `proxies` (in order)."""
    urls = ",".join(p.url(PROXY_PORT) for p in proxies)
    return host.kvroute("worker", "--engine", "sim", "--host", "0.0.0.0", "--port", str(port),
                        "--served-model-name", MODEL, "--worker-id", worker_id, "--proxy-url", urls,
                        "--proxy-token", WORKER_TOKEN, "--time-scale", f"{time_scale:g}", "--drain-grace-s", "5",
                        *extra, name=worker_id)


def workers(proxy: Host) -> dict[str, dict[str, Any]]:
    body = httpx.get(f"{proxy.url(PROXY_PORT)}/workers", headers=ADMIN, timeout=3).json()
    return {w["worker_id"]: w for w in body["workers"]}


def ready(proxy: Host) -> set[str]:
    return {wid for wid, w in workers(proxy).items() if w["state"] == "ready"}


def wait_ready(proxy: Host, expected: set[str], timeout: float = 60) -> None:
    try:
        wait_until(lambda: ready(proxy) == expected, timeout, 0.1, f"{expected} ready on {proxy.name}")
    except TimeoutError:
        raise AssertionError(f"{proxy.name} sees {workers(proxy)}, expected {expected} ready") from None


_DECISION = re.compile(r'^kvroute:routing_decisions(?:_total)?\{([^}]*)\}\s+([0-9.e+]+)', re.M)


def decisions_by_worker(proxy: Host) -> Counter[str]:
    """Routing decisions so far per worker (every attempt the proxy sent there, retries included)."""
    text = httpx.get(f"{proxy.url(PROXY_PORT)}/metrics", headers=ADMIN, timeout=3).text
    out: Counter[str] = Counter()
    for labels, value in _DECISION.findall(text):
        m = re.search(r'worker="([^"]*)"', labels)
        if m:
            out[m.group(1)] += int(float(value))
    return out


class DecisionWatch:
    """Polls a proxy's routing decisions in the background: when did a worker last get one?"""

    def __init__(self, proxy: Host, interval: float = 0.05) -> None:
        self.proxy, self.interval = proxy, interval
        self.last_change: dict[str, float] = {}
        self.counts: Counter[str] = Counter()
        self.read_since = 0.0  # when the last completed read of the proxy's counters began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DecisionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                now_counts = decisions_by_worker(self.proxy)
                read = True
            except httpx.HTTPError:
                now_counts, read = self.counts, False
            t = time.monotonic()
            for wid, n in now_counts.items():
                if n != self.counts.get(wid):
                    self.last_change[wid] = t
            self.counts = now_counts
            if read:
                self.read_since = began
            time.sleep(self.interval)

    def wait_read_after(self, moment: float, timeout: float = 10.0) -> None:
        """Until a read of the counters that began after `moment` is in: every decision made before it shows."""
        wait_until(lambda: self.read_since > moment, timeout, 0.02, "a read of the proxy's decision counters")

    def first_change_after(self, worker_id: str, since: float, timeout: float) -> float:
        base = self.counts.get(worker_id, 0)
        wait_until(lambda: self.last_change.get(worker_id, 0) > since and self.counts.get(worker_id, 0) > base,
                   timeout, 0.02, f"a request routed to {worker_id}")
        return self.last_change[worker_id]


@dataclass
class Outcome:
    started: float
    ended: float
    worker: str | None
    error: str | None


@dataclass
class Load:
    """`concurrency` client threads sending small chat requests to `url` until stopped; every outcome kept."""

    url: str
    concurrency: int = 4
    max_tokens: int = 8
    stream_every: int = 0  # every Nth request of a client streams (0: none)
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.concurrency)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                n += 1
                body = {"model": MODEL, "max_tokens": self.max_tokens,
                        "messages": [{"role": "user", "content": f"client {i} request {n}"}]}
                started = time.monotonic()
                try:
                    if self.stream_every and n % self.stream_every == 0:
                        worker, error = self._stream(client, body)
                    else:
                        r = client.post(f"{self.url}/v1/chat/completions", json=body)
                        worker = r.headers.get("x-kvroute-worker")
                        error = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    worker, error = None, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.outcomes.append(Outcome(started, time.monotonic(), worker, error))

    def _stream(self, client: httpx.Client, body: dict[str, Any]) -> tuple[str | None, str | None]:
        with client.stream("POST", f"{self.url}/v1/chat/completions", json={**body, "stream": True}) as r:
            worker = r.headers.get("x-kvroute-worker")
            if r.status_code != 200:
                return worker, f"HTTP {r.status_code}: {r.read()[:200]!r}"
            lines = [line for line in r.iter_lines() if line]
            if not lines or lines[-1] != "data: [DONE]":
                return worker, f"stream broken after {len(lines)} lines"
            errors = [line for line in lines if line.startswith('data: {"error"')]
            if errors:  # the proxy ends a stream its worker broke with an error event, then [DONE]
                return worker, f"stream failed mid-way after {len(lines)} lines: {errors[0][:200]}"
            return worker, None

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def served_by(self) -> Counter[str]:
        return Counter(o.worker for o in self.snapshot() if o.error is None)

    def failures(self, start: float = 0.0, end: float = float("inf")) -> list[Outcome]:
        """Failed requests that were in flight at some point in [start, end]."""
        return [o for o in self.snapshot() if o.error is not None and o.ended >= start and o.started <= end]

    def wait_served(self, n: int, timeout: float = 30) -> None:
        base = len([o for o in self.snapshot() if o.error is None])
        wait_until(lambda: len([o for o in self.snapshot() if o.error is None]) >= base + n, timeout, 0.05,
                   f"{n} more requests served")
