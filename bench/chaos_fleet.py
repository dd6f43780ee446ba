"""The chaos benchmark's fleet (bench/chaos.py): its settings, and the processes it starts and faults by PID: a
kvroute proxy, N sim workers (each id keeps its port across restarts), a redis-server of its own; SIGKILL and
restart, SIGSTOP and SIGCONT, the proxy's open fds and RSS.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench.fleet import KVROUTE, free_port
from bench.peers import spawn, stop_process_group, wait_ready
from bench.procstat import ProcessTree, descendants

FULL_REQUESTS, FULL_ROUNDS = 2000, 3
MODEL = "m"


@dataclass
class ChaosSettings:
    workers: int = 4
    requests: int = FULL_REQUESTS          # per round
    rounds: int = FULL_ROUNDS
    concurrency: int = 32
    kills: int = 3                         # SIGKILL + restart with the same id, per round
    stalls: int = 2                        # SIGSTOP ... SIGCONT, per round
    stall_s: tuple[float, float] = (3.0, 8.0)
    fail_rate: float = 0.2                 # the last worker answers this share of requests with HTTP 500
    slow_start_s: float = 2.0              # every other restart waits this long before listening
    state: str = "memory"                  # or "redis": a redis-server of the run's own, restarted each round
    time_scale: float = 1.0
    max_tokens: tuple[int, int] = (8, 48)
    deadline_s: float = 30.0               # a request still open after this is a hang
    seed: int = 0


# --- processes -----------------------------------------------------------------------------------------

@dataclass
class Slot:
    """One worker id: its port, flags and current process (restarts keep the id and the port)."""

    worker_id: str
    port: int
    extra: list[str]
    popen: subprocess.Popen[bytes] | None = None
    faulted: str = ""     # "", "killed", "restarting" (until ready at the proxy) or "stalled"
    restarts: int = 0


@dataclass
class ChaosFleet:
    settings: ChaosSettings
    log_dir: Path
    proxy_port: int = field(default_factory=free_port)
    redis_port: int = field(default_factory=free_port)
    slots: list[Slot] = field(default_factory=list)
    proxy: subprocess.Popen[bytes] | None = None
    redis: subprocess.Popen[bytes] | None = None
    kills_done: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def fail_slot(self) -> Slot | None:
        return self.slots[-1] if self.settings.fail_rate > 0 else None

    def start(self) -> None:
        s = self.settings
        state = "memory"
        if s.state == "redis":
            self.start_redis()
            state = f"redis://127.0.0.1:{self.redis_port}/0"
        self.proxy = spawn([*KVROUTE, "proxy", "--host", "127.0.0.1", "--port", str(self.proxy_port),
                            "--state", state, "--log-level", "warning"], self.log_dir / "proxy.log")
        wait_ready(self.url, self.proxy, self.log_dir / "proxy.log", path="/health")
        for i in range(s.workers):
            extra = ["--fail-rate", str(s.fail_rate)] if s.fail_rate > 0 and i == s.workers - 1 else []
            self.slots.append(Slot(f"sim-{i}", free_port(), extra))
        for slot in self.slots:
            self.spawn_worker(slot)
        for slot in self.slots:
            wait_ready(f"http://127.0.0.1:{slot.port}", slot.popen, self.log_dir / f"{slot.worker_id}-0.log",
                       path="/health")

    def spawn_worker(self, slot: Slot, slow_start_s: float = 0.0) -> None:
        s = self.settings
        args = [*KVROUTE, "worker", "--engine", "sim", "--port", str(slot.port), "--served-model-name", MODEL,
                "--time-scale", str(s.time_scale), "--seed", str(slot.restarts), "--worker-id", slot.worker_id,
                "--proxy-url", self.url, "--drain-grace-s", "1", "--log-level", "warning", *slot.extra]
        if slow_start_s > 0:
            args += ["--slow-start", str(slow_start_s)]
        slot.popen = spawn(args, self.log_dir / f"{slot.worker_id}-{slot.restarts}.log")  # a log per start

    def start_redis(self) -> None:
        self.redis = spawn(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no"], self.log_dir / "redis.log")

    def stop(self) -> None:
        for slot in self.slots:
            if slot.popen is not None:
                self._signal(slot, signal.SIGCONT)  # a frozen process cannot act on SIGTERM
                stop_process_group(slot.popen, timeout=5)
        if self.proxy is not None:
            stop_process_group(self.proxy)
        if self.redis is not None:
            stop_process_group(self.redis)

    @staticmethod
    def _signal(slot: Slot, sig: int) -> None:
        if slot.popen is not None and slot.popen.poll() is None:
            try:
                os.killpg(slot.popen.pid, sig)
            except ProcessLookupError:
                pass

    # --- faults -------------------------------------------------------------------------------------
    def kill(self, slot: Slot) -> None:
        self._signal(slot, signal.SIGKILL)
        if slot.popen is not None:
            slot.popen.wait(10)
        slot.faulted = "killed"

    def restart(self, slot: Slot, slow_start_s: float) -> None:
        slot.restarts += 1
        self.spawn_worker(slot, slow_start_s)
        slot.faulted = "restarting"

    def freeze(self, slot: Slot) -> None:
        self._signal(slot, signal.SIGSTOP)
        slot.faulted = "stalled"

    def thaw(self, slot: Slot) -> None:
        self._signal(slot, signal.SIGCONT)
        slot.faulted = ""

    def restart_redis(self) -> None:
        if self.redis is not None:
            stop_process_group(self.redis, timeout=5)
        self.start_redis()

    def proxy_fds(self) -> int:
        n = 0
        for pid in descendants(self.proxy.pid):
            try:
                n += len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                pass
        return n

    def proxy_rss_mb(self) -> float:
        return ProcessTree(self.proxy.pid).rss_bytes() / 2**20
