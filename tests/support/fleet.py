"""Test helper: a real `kvroute proxy` process and real `sim` workers, started through `procs`.

Every process goes through the `procs` fixture, so it is stopped by PID when the test ends.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.procs import Proc, ProcessGroup, admin_headers, free_port, wait_http_ok, wait_until


@dataclass
class Sim:
    url: str
    proc: Proc
    worker_id: str | None


class Fleet:
    def __init__(self, procs: ProcessGroup, tmp_path: Path) -> None:
        self.procs = procs
        self.tmp_path = tmp_path
        self.url = ""
        self.proxy: Proc | None = None  # the proxy process, once started
        self.http = httpx.Client(timeout=30.0)
        self.secrets: dict[str, str] = {}  # worker id -> the secret its registration returned

    def close(self) -> None:
        self.http.close()

    # --- processes ------------------------------------------------------------------------
    def start_proxy(self, *args: str, config: str | None = None) -> str:
        port = free_port()
        extra = list(args)
        if config is not None:
            path = self.tmp_path / "config.yaml"
            path.write_text(config)
            extra += ["--config", str(path)]
        self.proxy = self.procs.kvroute("proxy", "--port", str(port), *extra, name="proxy")
        self.url = f"http://127.0.0.1:{port}"
        wait_http_ok(self.url + "/health", timeout=30)
        return self.url

    def start_sims(self, count: int, model: str = "m1", register: bool = True, time_scale: float = 20.0,
                   kv_capacity_tokens: int = 65536, extra: tuple[str, ...] = (), prefix: str = "sim") -> list[Sim]:
        sims = []
        for i in range(count):
            port = free_port()
            worker_id = f"{prefix}-{i}"
            args = ["worker", "--engine", "sim", "--port", str(port), "--served-model-name", model,
                    "--time-scale", str(time_scale), "--kv-capacity-tokens", str(kv_capacity_tokens),
                    "--drain-grace-s", "1", *extra]
            if register:
                args += ["--proxy-url", self.url, "--worker-id", worker_id]
            proc = self.procs.kvroute(*args, name=worker_id)
            sims.append(Sim(f"http://127.0.0.1:{port}", proc, worker_id if register else None))
        for sim in sims:
            wait_http_ok(sim.url + "/health", timeout=30)
        if register:
            ids = {s.worker_id for s in sims}
            self.wait_workers(lambda ws: ids <= {w["worker_id"] for w in ws if w["state"] == "ready"},
                              what=f"{count} sims ready at the proxy")
        return sims

    # --- control plane ------------------------------------------------------------------------
    def admin(self) -> dict[str, str]:
        """Headers that administer this fleet's proxy (drain, remove): its admin token."""
        return admin_headers(self.url)

    def workers(self) -> list[dict]:
        return self.http.get(self.url + "/workers").json()["workers"]

    def worker(self, worker_id: str) -> dict:
        return self.http.get(f"{self.url}/workers/{worker_id}").json()

    def wait_workers(self, predicate, timeout: float = 20.0, what: str = "workers") -> list[dict]:
        return wait_until(lambda: (lambda ws: ws if predicate(ws) else None)(self.workers()), timeout,
                          0.05, what)

    def register(self, worker_id: str, url: str, model: str = "m1", capacity: int = 20000) -> None:
        secret = self.secrets.get(worker_id)  # registering again: as a worker does, with its own secret
        resp = self.http.post(self.url + "/workers", headers={"Authorization": f"Bearer {secret}"} if secret else {},
                              json={"worker_id": worker_id, "url": url, "models": [model], "engine": "sim",
                                    "kv_capacity_tokens": capacity})
        resp.raise_for_status()
        self.secrets[worker_id] = resp.json()["worker_secret"]

    def report(self, worker_id: str, url: str, usage: float, model: str = "m1", capacity: int = 20000,
               waiting: int = 0) -> None:
        self._seq = getattr(self, "_seq", 0) + 1
        secret = self.secrets.get(worker_id)  # a worker reports with its own secret
        resp = self.http.post(f"{self.url}/workers/{worker_id}/report", headers=(
            {"Authorization": f"Bearer {secret}"} if secret else self.admin()), json={
            "worker_id": worker_id, "url": url, "models": [model], "engine": "sim", "state": "ready",
            "kv_cache_usage": usage, "kv_capacity_tokens": capacity, "num_running": 0, "num_waiting": waiting,
            "seq": self._seq, "sent_at": time.time()})
        resp.raise_for_status()

    # --- data plane ---------------------------------------------------------------------------
    def chat(self, content: str = "hello", model: str = "m1", max_tokens: int = 8, **extra) -> httpx.Response:
        return self.http.post(self.url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra})


class FakeReports:
    """Reports made-up load for registered workers at 4 Hz from a thread, until stopped."""

    def __init__(self, fleet: Fleet, loads: dict[str, tuple[str, float] | tuple[str, float, int]],
                 model: str = "m1") -> None:
        self.fleet, self.loads, self.model = fleet, loads, model
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._client = httpx.Client(timeout=5.0)
        self._seq = 0

    def __enter__(self) -> FakeReports:
        self._send()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()

    def _send(self) -> None:
        self._seq += 1
        for worker_id, (url, usage, *waiting) in self.loads.items():  # (url, usage[, requests waiting])
            secret = self.fleet.secrets[worker_id]  # registered through fleet.register
            self._client.post(f"{self.fleet.url}/workers/{worker_id}/report", headers={
                "Authorization": f"Bearer {secret}"}, json={
                "worker_id": worker_id, "url": url, "models": [self.model], "engine": "sim", "state": "ready",
                "kv_cache_usage": usage, "kv_capacity_tokens": 20000, "num_running": 4 if waiting else 0,
                "num_waiting": waiting[0] if waiting else 0,
                "seq": self._seq, "sent_at": time.time()})

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self._send()
            except httpx.HTTPError:
                pass
