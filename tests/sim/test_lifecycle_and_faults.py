"""Sim worker lifecycle (register, report, drain on SIGTERM, deregister) and its fault flags."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.sim.conftest import read_state
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(60)


class RecordingControlPlane:
    """A stand-in for the proxy's control plane (POST /workers, reports, DELETE) that records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict | None]] = []
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                plane.calls.append(("POST", self.path, body))
                if self.path == "/workers":
                    self._answer(200, {"worker_id": body.get("worker_id") or "w1", "report_interval_s": 0.25})
                else:
                    self._answer(200, {})

            def do_DELETE(self) -> None:  # noqa: N802
                plane.calls.append(("DELETE", self.path, None))
                self._answer(200, {})

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def reports(self) -> list[dict]:
        return [body for method, path, body in list(self.calls) if path.endswith("/report") and body]


@pytest.fixture
def control_plane() -> Iterator[RecordingControlPlane]:
    plane = RecordingControlPlane()
    plane.thread.start()
    yield plane
    plane.server.shutdown()
    plane.server.server_close()


def test_sigterm_drains_in_flight_work_reports_draining_and_deregisters(sim, control_plane):
    proc, url = sim("--preset", "cpu-tiny", "--served-model-name", "m", "--proxy-url", control_plane.url,
                    "--worker-id", "sim-a", "--drain-grace-s", "20")
    registration = wait_until(lambda: next((b for m, p, b in control_plane.calls if p == "/workers"), None), 10,
                              what="registration")
    assert registration["engine"] == "sim" and registration["models"] == ["m"]
    assert registration["url"] == url and registration["kv_capacity_tokens"] == 4096
    wait_until(lambda: len(control_plane.reports()) >= 2, 10, what="load reports")
    assert control_plane.reports()[-1]["state"] == "ready"

    received: list[str] = []
    body = {"model": "m", "max_tokens": 300, "stream": True, "messages": [{"role": "user", "content": "go"}]}

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            received.extend(response.iter_lines())

    client = threading.Thread(target=stream)
    client.start()
    wait_until(lambda: read_state(url)["num_running"] == 1, 10, what="the request to run")
    busy_report = wait_until(lambda: next((r for r in reversed(control_plane.reports()) if r["num_running"] == 1),
                                          None), 5, what="a report showing the running request")
    assert busy_report["kv_cache_usage"] > 0
    proc.signal(signal.SIGTERM)

    wait_until(lambda: any(r["state"] == "draining" for r in control_plane.reports()), 10, what="a draining report")
    refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    client.join(30)
    assert [line for line in received if line][-1] == "data: [DONE]"
    assert sum('"delta":{"content"' in line for line in received) == 300  # the in-flight answer was whole
    assert proc.popen.wait(20) == 0
    assert ("DELETE", "/workers/sim-a", None) in control_plane.calls


def test_fail_rate_one_answers_every_request_with_a_500_error_body(sim):
    _, url = sim("--fail-rate", "1.0", "--served-model-name", "m")
    response = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=5)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"
    assert httpx.get(f"{url}/health").status_code == 200


def test_crash_after_n_requests_kills_the_process(sim):
    proc, url = sim("--crash-after", "1", "--served-model-name", "m", "--time-scale", "10")
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{url}/v1/completions", json=body, timeout=5)
    assert proc.popen.wait(10) == 1


def test_stall_after_n_requests_stops_tokens_but_keeps_health(sim):
    _, url = sim("--stall-after", "1", "--served-model-name", "m", "--time-scale", "10")
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    state = read_state(url)
    assert state["stalled"] and state["num_finished"] == 1
    assert httpx.get(f"{url}/health").status_code == 200


def test_slow_start_delays_listening(sim):
    proc, _ = sim("--slow-start", "0.3")
    log = proc.log()
    assert log.index("--slow-start") < log.index("kvroute-sim listening")


def test_bad_flags_exit_with_a_message_naming_the_flag(procs):
    proc = procs.kvroute("worker", "--engine", "sim", "--port", "0", "--preset", "cpu-tiny",
                         "--kv-capacity-tokens", "64", name="bad-sim")
    assert proc.popen.wait(30) == 2
    assert "--kv-capacity-tokens" in proc.log()
