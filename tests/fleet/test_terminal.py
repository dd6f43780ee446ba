"""The operator's terminal: `kvroute up` and `kvroute status` in a pseudo-terminal 80 columns wide, as a new
user sees them. Sim workers only; every process is stopped by PID (the `procs` fixture).

Also the table-fitting rules alone (render.fit_columns), without processes.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import termios
import threading
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from proxy.fleet.render import fleet_tables
from tests.support.procs import KVROUTE, REPO, Proc, ProcessGroup, admin_headers, free_port, wait_until

pytestmark = pytest.mark.timeout(240)

COLS = 80
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]|\x1b[=>]")


class Terminal:
    """A process whose stdin/stdout/stderr are a pseudo-terminal of COLS columns; output is collected."""

    def __init__(self, procs: ProcessGroup, args: list[str], name: str, cwd: Path, env: dict[str, str]) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLS, 0, 0))
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERM": "xterm-256color", "COLUMNS": str(COLS),
                    "LINES": "40", **env}
        for key in ("KVROUTE_RUN_DIR", "KVROUTE_PROXY_URL", "NO_COLOR"):
            full_env.pop(key, None)
        popen = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=full_env,
                                 start_new_session=True)
        os.close(slave)
        self.log_path = procs.log_dir / f"{name}-{len(procs.procs)}.log"
        self.proc = Proc(popen, self.log_path, name)
        procs.procs.append(self.proc)  # stopped by PID with everything else the test started
        self._master = master
        self._raw = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "wb") as log:
            while True:
                try:
                    chunk = os.read(self._master, 65536)
                except OSError:  # the other side closed: the process exited
                    break
                if not chunk:
                    break
                self._raw += chunk
                log.write(chunk)
                log.flush()

    def text(self) -> str:
        return ANSI.sub("", bytes(self._raw).decode(errors="replace")).replace("\r\n", "\n").replace("\r", "\n")

    def wait_for(self, needle: str, timeout: float = 60.0) -> str:
        return wait_until(lambda: self.text() if needle in self.text() else None, timeout, 0.1,
                          f"{needle!r} on the terminal")

    def wait_exit(self, timeout: float = 60.0) -> int:
        code = self.proc.popen.wait(timeout)
        self._reader.join(5)
        return code


def _too_wide(text: str) -> list[str]:
    return [line for line in text.split("\n") if len(line.rstrip()) > COLS]


def _status(procs: ProcessGroup, url: str, cwd: Path) -> str:
    term = Terminal(procs, [*KVROUTE, "status", "--proxy", url], "status", cwd, {"PYTHONPATH": str(REPO)})
    assert term.wait_exit(30) == 0, term.text()
    return term.text()


CONFIG = """\
proxy:
  host: 127.0.0.1
  drain_grace_s: 5
models:
  - name: qwen3-vl-tiny-sim
    engine: sim
    preset: cpu-tiny
    device: cpu
    replicas: 2
    engine_args: {time-scale: 1}
"""


def test_up_in_an_80_column_terminal_fits_tells_how_to_stop_and_where_logs_are(procs, tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text(CONFIG)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Terminal(procs, [*KVROUTE, "up", str(config), "--port", str(port), "--restart-backoff-s", "0.2"], "up",
                  tmp_path, {"PYTHONPATH": str(REPO)})
    try:
        shown = up.wait_for("stop:", timeout=90)
        ready_at = shown.index("ready: OpenAI endpoint")
        banner = shown[ready_at:]
        # The status table and the hints fit 80 columns, and the cells say something.
        assert _too_wide(banner) == [], banner
        for wid in ("qwen3-vl-tiny-sim-0", "qwen3-vl-tiny-sim-1"):
            assert re.search(rf"{wid}\s+ready", banner), banner
        assert "…" not in banner
        # The hints: how to stop, where the logs are, how to call the CLI.
        logs = tmp_path / ".kvroute" / "logs"
        assert "stop:      Ctrl-C" in banner and "logs:      .kvroute/logs/" in banner
        # A long venv path splits the command with a shell line continuation, still one command to paste.
        assert "status --proxy " + url in re.sub(r" \\\n\s+", " ", banner), banner
        assert (logs / "kvroute-up.log").exists() and (logs / "qwen3-vl-tiny-sim-0.log").exists()
        assert "INFO" not in shown  # info lines go to the log file, not also to the terminal

        # `kvroute status` at 80 columns: a worker whose reports stop shows as stale (then, once the proxy's
        # health probe times out, unhealthy), with why; never as `starting`.
        fleet = httpx.get(url + "/fleet", headers=admin_headers(url), timeout=5).json()
        pid = next(r["pid"] for r in fleet["replicas"] if r["worker_id"] == "qwen3-vl-tiny-sim-1")
        os.kill(pid, signal.SIGSTOP)
        not_ready = r"qwen3-vl-tiny-sim-1\s+(stale|unhealthy)"
        try:
            text = wait_until(lambda: (lambda t: t if re.search(not_ready, t) else None)(
                _status(procs, url, tmp_path)), 30, 0.5, "the stopped worker to show as stale or unhealthy")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert _too_wide(text) == [], text
        assert ("last load report" in text or "probe failed" in text) and "starting" not in text
        assert re.search(r"qwen3-vl-tiny-sim-0\s+ready", text)

        # A config edit that is rejected shows in the status, with when.
        config.write_text(CONFIG.replace("replicas: 2", "replicas: -1"))
        text = wait_until(lambda: (lambda t: t if "config edit rejected at" in t else None)(
            _status(procs, url, tmp_path)), 30, 0.5, "the rejected edit in kvroute status")
        assert "replicas" in text

        up.proc.signal(signal.SIGINT)
        assert up.wait_exit(60) == 0
        assert up.text().count("kvroute up: stopped") == 1
    finally:
        up.proc.stop()

    # Nothing listening any more: `kvroute status` says so and suggests --proxy.
    gone = subprocess.run([*KVROUTE, "status", "--proxy", url], capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1 and "--proxy" in gone.stderr


WORKERS = {f"qwen3-vl-8b-instruct-{i}": {
    "worker_id": f"qwen3-vl-8b-instruct-{i}", "state": "unhealthy" if i == 1 else "ready", "breaker_open": i == 1,
    "last_error": "connect refused by 10.0.0.7:8101", "url": f"http://10.0.0.{i}:8101", "models": ["q"],
    "last_report": {"engine": "pytorch", "kv_cache_usage": 0.4, "num_running": 3, "num_waiting": 0}}
    for i in range(3)}
FLEET = {"models": [{"name": "q", "desired_replicas": 3, "engine": "turbomind", "placement": "local"}],
         "replicas": [{"worker_id": wid, "model": "q", "state": "starting", "registered_state": w["state"],
                       "engine": "turbomind", "gpus": ["0", "1", "2", "3"], "started_at": 100.0, "restarts": 2}
                      for wid, w in WORKERS.items()],
         "last_error": "config edit rejected at 12:00:00 (the fleet runs the previous version): bad replicas"}


@pytest.mark.parametrize("width", [60, 80, 100, 200])
def test_tables_fit_the_width_keeping_id_state_and_kv_whole(width):
    console = Console(width=width, record=True, color_system=None)
    for part in fleet_tables(WORKERS, FLEET, now=400.0, width=width):
        console.print(part)
    text = console.export_text()
    table_lines = [ln for ln in text.split("\n") if ln.startswith("qwen3-vl-8b-instruct-")]
    assert len(table_lines) == 3 and all(len(ln.rstrip()) <= width for ln in table_lines), text
    assert "unhealthy" in text and "40%" in text and "…" not in table_lines[0]
    assert "config edit rejected at 12:00:00" in text
    if width >= 200:  # wide: every column, the reason whole, and TurboMind's fallback engine
        assert "circuit open after failures: connect refused by 10.0.0.7:8101" in text
        assert "turbomind>pytorch" in text and "0,1,2,3" in text
    if width == 80:  # the reason survives, cut short, before the host does
        assert "circuit open" in text


def test_manager_starting_is_not_shown_when_the_proxy_knows_better():
    console = Console(width=COLS, record=True, color_system=None)
    workers = {"w-0": {"worker_id": "w-0", "state": "stale", "reading_age_s": 12.0, "models": ["q"]}}
    fleet = {"models": [], "replicas": [{"worker_id": "w-0", "model": "q", "state": "starting",
                                         "registered_state": "stale", "engine": "vllm", "started_at": 1.0}]}
    for part in fleet_tables(workers, fleet, now=600.0, width=COLS):
        console.print(part)
    text = console.export_text()
    assert "stale" in text and "last load report 12s ago" in text and "starting" not in text


def test_status_hint_splits_a_long_command_with_a_line_continuation():
    from proxy.fleet.cmd_up import _status_hint

    hint = _status_hint("http://127.0.0.1:35801", 60)
    assert all(len(line) <= 60 for line in hint.splitlines()[1:]), hint
    assert hint.splitlines()[0].endswith(" \\") and hint.splitlines()[1].strip() == "--proxy http://127.0.0.1:35801"
