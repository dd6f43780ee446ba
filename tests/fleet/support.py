"""Helpers for tests that run `kvroute up`: start it on a config, read /fleet and /workers, send load,
and make sure every worker PID it started is gone when the test ends."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import Proc, ProcessGroup, admin_headers, free_port, wait_until


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead for our purposes
    except OSError:
        return False


def processes_in_groups(pgids: set[int]) -> list[int]:
    """PIDs of live processes whose process group is one of `pgids` (engine children included)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) in pgids:
                found.append(int(entry))
    return found


class Fleet:
    """A running `kvroute up` and what the test knows about it."""

    def __init__(self, procs: ProcessGroup, tmp_path: Path, config: str, *extra: str,
                 env: dict[str, str] | None = None, name: str = "up", token: str | None = None) -> None:
        self._token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = tmp_path / "fleet.yaml"
        self.write_config(config)
        self.run_dir = tmp_path / "run"
        self.seen_worker_pids: set[int] = set()
        self.proc: Proc = procs.kvroute(
            "up", str(self.config_path), "--port", str(self.port), "--run-dir", str(self.run_dir),
            "--restart-backoff-s", "0.2", *extra, name=name, env=env)

    @property
    def headers(self) -> dict[str, str]:
        """The admin's: the token given, else the one `kvroute up` made (tests.conftest's KVROUTE_CONFIG_DIR)."""
        return {"Authorization": f"Bearer {self._token}"} if self._token else admin_headers(self.url)

    def write_config(self, text: str) -> None:
        # Write-then-rename, as editors do, so the watcher never reads half a file.
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(textwrap.dedent(text))
        tmp.replace(self.config_path)

    def fleet(self) -> dict[str, Any]:
        body = httpx.get(f"{self.url}/fleet", headers=self.headers, timeout=5).json()
        self.seen_worker_pids |= {r["pid"] for r in body["replicas"] if r.get("pid")}
        return body

    def workers(self) -> dict[str, dict[str, Any]]:
        body = httpx.get(f"{self.url}/workers", headers=self.headers, timeout=5).json()
        records = body.get("workers", body) if isinstance(body, dict) else body
        return {w["worker_id"]: w for w in records}

    def ready_ids(self) -> set[str]:
        return {wid for wid, w in self.workers().items() if w["state"] == "ready"}

    def wait_workers(self, expected: set[str] | int, timeout: float = 60) -> set[str]:
        """Until the proxy knows exactly these workers (or exactly this many), all ready."""
        def check() -> set[str] | None:
            workers = self.workers()
            ids = set(workers)
            ok = ids == expected if isinstance(expected, set) else len(ids) == expected
            if ok and all(w["state"] == "ready" for w in workers.values()):
                self.fleet()
                return ids or {"<none>"}
            return None
        try:
            return wait_until(check, timeout, 0.2, f"workers == {expected}")
        except TimeoutError:
            raise AssertionError(f"workers never became {expected}: {self.workers()}\n{self.proc.log()[-3000:]}") from None

    def kill_leftovers(self) -> list[int]:
        """Teardown safety net: SIGKILL any worker this test saw that is still alive; returns those PIDs."""
        left = [pid for pid in self.seen_worker_pids if pid_alive(pid)]
        for pid in left:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return left


@dataclass
class LoadResult:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    by_worker: Counter[str] = field(default_factory=Counter)


class SteadyLoad:
    """`concurrency` client threads sending chat requests (half streaming) until stopped."""

    def __init__(self, url: str, model: str, concurrency: int = 4, max_tokens: int = 24) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.result = LoadResult()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.result

    def _one(self, client: httpx.Client, n: int, stream: bool) -> tuple[str | None, str | None]:
        body = {"model": self.model, "max_tokens": self.max_tokens, "stream": stream,
                "messages": [{"role": "user", "content": f"request {n}: tell me about GPUs"}]}
        if not stream:
            r = client.post(f"{self.url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                return None, f"HTTP {r.status_code}: {r.text[:200]}"
            return r.headers.get("x-kvroute-worker"), None
        with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return None, f"HTTP {r.status_code}: {r.read()[:200]!r}"
            lines = [line for line in r.iter_lines() if line]
            if not lines or lines[-1] != "data: [DONE]":
                return None, f"stream ended without [DONE] after {len(lines)} lines"
            return r.headers.get("x-kvroute-worker"), None

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                n += 1
                try:
                    worker, err = self._one(client, n, stream=(n + i) % 2 == 0)
                except httpx.HTTPError as exc:
                    worker, err = None, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if err:
                        self.result.failures.append(err)
                    else:
                        self.result.ok += 1
                        self.result.by_worker[worker or "?"] += 1


def sim_model(name: str, replicas: int, *, time_scale: float = 1.0, extra: str = "", gpus: int = 0) -> str:
    """One sim model entry for a config that starts with `models:` (indented like HEAD in test_up.py)."""
    device = "cuda" if gpus else "cpu"
    return f"""
      - name: {name}
        engine: sim
        preset: cpu-tiny
        device: {device}
        replicas: {replicas}
        gpus_per_replica: {gpus}
        engine_args: {{time-scale: {time_scale:g}{extra}}}"""
