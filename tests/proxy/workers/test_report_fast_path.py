"""A worker's own load report is answered on the public port itself; everything else about reports is unchanged.

A real `kvroute proxy` process with an admin token (so loopback callers are not admins, and every refusal
comes from the control plane as before): the worker's valid report is recorded and answered with the report
interval, keep-alive and pipelined; a bad body, another worker's id, a wrong secret, an unknown worker and
an old sequence number get what they got before the fast path existed.
"""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from tests.support.procs import wait_until

ADMIN, WORKER_TOKEN = "adm1n-t0ken", "w0rker-t0ken"
CONFIG = f"proxy:\n  admin_token: {ADMIN}\n  worker_token: {WORKER_TOKEN}\n"


def _report(worker_id: str, seq: int, usage: float = 0.25, **extra: object) -> dict[str, object]:
    return {"worker_id": worker_id, "url": "http://127.0.0.1:9", "models": ["m1"], "engine": "sim",
            "state": "ready", "kv_cache_usage": usage, "kv_capacity_tokens": 20000, "num_running": 1,
            "num_waiting": 0, "seq": seq, "sent_at": time.time(), **extra}


@pytest.fixture
def proxy(fleet):
    fleet.start_proxy(config=CONFIG)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    resp = fleet.http.post(fleet.url + "/workers", headers={"Authorization": f"Bearer {WORKER_TOKEN}"},
                           json={"worker_id": "w1", "url": "http://127.0.0.1:9", "models": ["m1"], "engine": "sim"})
    assert resp.status_code == 200, resp.text
    return fleet, resp.json()["worker_secret"], admin


def test_a_workers_own_report_is_recorded_and_answered_with_the_interval_to_keep(proxy):
    fleet, secret, admin = proxy
    mine = {"Authorization": f"Bearer {secret}"}
    resp = fleet.http.post(fleet.url + "/workers/w1/report", headers=mine, json=_report("w1", 1, usage=0.25))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    assert resp.json() == {"ok": True, "report_interval_s": 0.05}  # one worker: the fastest cadence
    shown = fleet.http.get(fleet.url + "/workers/w1", headers=admin).json()
    assert shown["last_report"]["seq"] == 1 and shown["reading_source"] == "report"
    assert shown["projected_kv_usage"] == pytest.approx(0.25)

    # an older report never overwrites a newer one; a newer one does
    assert fleet.http.post(fleet.url + "/workers/w1/report", headers=mine,
                           json=_report("w1", 1, usage=0.9)).status_code == 200
    assert fleet.http.get(fleet.url + "/workers/w1", headers=admin).json()["projected_kv_usage"] == pytest.approx(0.25)
    assert fleet.http.post(fleet.url + "/workers/w1/report", headers=mine,
                           json=_report("w1", 2, usage=0.5)).status_code == 200
    assert fleet.http.get(fleet.url + "/workers/w1", headers=admin).json()["projected_kv_usage"] == pytest.approx(0.5)


def test_refused_reports_get_the_control_planes_answers(proxy):
    fleet, secret, admin = proxy
    mine = {"Authorization": f"Bearer {secret}"}
    bad = fleet.http.post(fleet.url + "/workers/w1/report", headers=mine, json=_report("w1", 5, usage=2.0))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_cache_usage"
    other = fleet.http.post(fleet.url + "/workers/w1/report", headers=mine, json=_report("w2", 5))
    assert other.status_code == 400 and other.json()["error"]["param"] == "worker_id"
    not_json = fleet.http.post(fleet.url + "/workers/w1/report", content=b"{not json",
                               headers={**mine, "Content-Type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    for headers in ({}, {"Authorization": "Bearer not-the-secret"}, {"Authorization": f"Basic {secret}"},
                    {"Authorization": f"Bearer {WORKER_TOKEN}"}):
        denied = fleet.http.post(fleet.url + "/workers/w1/report", headers=headers, json=_report("w1", 6))
        assert denied.status_code in (401, 403) and "error" in denied.json(), headers
    # an id this secret does not own, registered or not: one answer (no id oracle, issue 33 item 10); a
    # worker's own secret that the proxy forgot gets 401, on which its reporter registers again
    unknown = fleet.http.post(fleet.url + "/workers/w9/report", headers=mine, json=_report("w9", 1))
    assert unknown.status_code == 403 and unknown.json()["error"]["code"] == "forbidden"
    forgotten = fleet.http.post(fleet.url + "/workers/w9/report", headers={"Authorization": "Bearer forgotten"},
                                json=_report("w9", 1))
    assert forgotten.status_code == 401
    # none of these changed what the proxy holds for w1
    assert fleet.http.get(fleet.url + "/workers/w1", headers=admin).json()["last_report"] is None
    # the admin may still report for a worker (through the control plane, as before)
    assert fleet.http.post(fleet.url + "/workers/w1/report", headers=admin, json=_report("w1", 7)).status_code == 200
    assert fleet.http.get(fleet.url + "/workers/w1", headers=admin).json()["last_report"]["seq"] == 7


def _read_responses(sock: socket.socket, count: int, deadline_s: float = 10.0) -> list[bytes]:
    """`count` whole responses (each with a Content-Length) off the socket, in order."""
    data, answers = b"", []
    end = time.monotonic() + deadline_s
    while len(answers) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].lower()
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(data) >= head_end + 4 + length:
                answers.append(data[:head_end + 4 + length])
                data = data[head_end + 4 + length:]
                continue
        assert time.monotonic() < end, f"only {len(answers)} of {count} answers within {deadline_s}s"
        sock.settimeout(max(0.01, end - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return answers


def test_reports_pipelined_on_one_connection_are_answered_in_order_and_close_when_asked(proxy):
    fleet, secret, admin = proxy
    port = int(fleet.url.rsplit(":", 1)[1])

    def request(seq: int, close: bool = False, body: dict[str, object] | None = None) -> bytes:
        payload = orjson.dumps(body or _report("w1", seq, usage=seq / 10))
        return (b"POST /workers/w1/report HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(payload)
                + (b"Connection: close\r\n" if close else b"") + b"\r\n" + payload)

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # a valid report, a refused one (bad usage: the control plane's 400), then one more valid, in one write
        sock.sendall(request(1) + request(2, body=_report("w1", 2, usage=-1)) + request(3, close=True))
        answers = _read_responses(sock, 3)
        assert [a.split(b" ", 2)[1] for a in answers] == [b"200", b"400", b"200"]
        assert b'"report_interval_s"' in answers[0] and b"connection: close" in answers[2].lower()
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed after the answer, as asked
    shown = wait_until(lambda: (lambda w: w if w["last_report"] and w["last_report"]["seq"] == 3 else None)(
        fleet.http.get(fleet.url + "/workers/w1", headers=admin).json()), 5, 0.05, "seq 3 recorded")
    assert shown["projected_kv_usage"] == pytest.approx(0.3)


def test_a_real_sim_worker_reports_through_the_fast_path(fleet):
    """Its reporter (backends/reporter.py) registers with the worker token and reports with its secret."""
    fleet.start_proxy(config=CONFIG)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    fleet.http.headers.update(admin)
    fleet.start_sims(1, extra=("--proxy-token", WORKER_TOKEN))
    first = fleet.worker("sim-0")["last_report"]["seq"]
    later = wait_until(lambda: (lambda s: s if s >= first + 5 else None)(fleet.worker("sim-0")["last_report"]["seq"]),
                       10, 0.05, "five more reports")
    assert later >= first + 5
    assert fleet.worker("sim-0")["step_tokens"] == 2048  # the cpu-tiny preset's budget per step, as it reported
    with httpx.Client(timeout=30) as client:
        resp = client.post(fleet.url + "/v1/chat/completions", json={
            "model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "sim-0"
