"""Explained decisions and access logs through the default data plane: an admin who sends `x-kvroute-debug: 1`
reads why the request went where it went; anyone else learns nothing; every request leaves one JSON line.
"""

from __future__ import annotations

import json
import sys

import pytest

from proxy.observability.decision import DebugGate, explain
from tests.support.fleet import Fleet
from tests.support.procs import free_port, wait_http_ok, wait_until

pytestmark = pytest.mark.timeout(120)

ADMIN = "admin-secret-token"
CLIENT_KEY = "sk-client-key-1"
CONFIG = f"""
proxy:
  admin_token: {ADMIN}
  log_level: info
  api_keys:
    - key: {CLIENT_KEY}
      name: team-a
"""
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "why here?"}], "max_tokens": 4}


@pytest.fixture
def fleet(procs, tmp_path):
    f = Fleet(procs, tmp_path)
    yield f
    f.close()


def _start(fleet: Fleet, procs) -> None:
    workers = []
    for _ in range(3):
        port = free_port()
        procs.start([sys.executable, "-m", "tests.support.raw_upstream", str(port)], name="raw-upstream")
        workers.append(f"http://127.0.0.1:{port}")
    for url in workers:
        wait_http_ok(url + "/health", timeout=20)
    fleet.start_proxy("--policy", "kv_aware", config=CONFIG)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for i, url in enumerate(workers):
        resp = fleet.http.post(fleet.url + "/workers", headers=admin,
                               json={"worker_id": f"raw-{i}", "url": url, "models": ["m1"], "reports": False})
        assert resp.status_code == 200, resp.text
    wait_until(lambda: [w["state"] for w in fleet.http.get(fleet.url + "/workers", headers=admin).json()["workers"]]
               == ["ready"] * 3, 20, 0.05, "three workers ready")


def _access_lines(proc) -> list[dict]:
    return [json.loads(line.split("kvroute.access: ", 1)[1]) for line in proc.log().splitlines()
            if "kvroute.access: " in line]


def test_an_admin_reads_why_and_every_request_leaves_one_json_line(fleet, procs):
    _start(fleet, procs)
    proxy = procs.procs[-1]
    assert proxy.name == "proxy"
    as_client = {"Authorization": f"Bearer {CLIENT_KEY}", "x-kvroute-debug": "1", "x-request-id": "req-plain"}

    # A client with a valid key but without the admin token: the debug header is ignored, no worker list leaks.
    plain = fleet.http.post(fleet.url + "/v1/chat/completions", headers=as_client, json=CHAT)
    assert plain.status_code == 200, plain.text
    assert "x-kvroute-decision" not in plain.headers
    wrong = fleet.http.post(fleet.url + "/v1/chat/completions", json=CHAT,
                            headers={**as_client, "x-kvroute-admin-token": "guess", "x-request-id": "req-wrong"})
    assert wrong.status_code == 200 and "x-kvroute-decision" not in wrong.headers

    # The admin token beside the client's key: the answer says why this worker.
    asked = fleet.http.post(fleet.url + "/v1/chat/completions", json=CHAT,
                            headers={**as_client, "x-kvroute-admin-token": ADMIN, "x-request-id": "req-debug"})
    assert asked.status_code == 200, asked.text
    fields = dict(part.split("=", 1) for part in asked.headers["x-kvroute-decision"].split("; "))
    assert fields["policy"] == "kv_aware" and fields["reason"]
    assert fields["chosen"] == asked.headers["x-kvroute-worker"]
    candidates = [c.split(":") for c in fields["candidates"].split(",")]
    assert sorted(w for w, _ in candidates) == ["raw-0", "raw-1", "raw-2"]
    scores = [float(s) for _, s in candidates]
    assert scores == sorted(scores)  # best (lowest) first
    assert dict(candidates)[fields["chosen"]] == candidates[0][1]  # the chosen one is among the cheapest
    # The admin token never reaches the worker (raw_upstream echoes the headers it got).
    received = {k.lower() for k, _ in asked.json()["headers"]}
    assert "x-kvroute-admin-token" not in received and "authorization" not in received

    # An unknown model: answered by the proxy itself, logged too.
    missing = fleet.http.post(fleet.url + "/v1/chat/completions", headers=as_client | {"x-request-id": "req-404"},
                              json={**CHAT, "model": "nope"})
    assert missing.status_code == 404

    # A wrong key: refused on the request's head, before its body is read; logged as well.
    refused = fleet.http.post(fleet.url + "/v1/chat/completions", json=CHAT,
                              headers={"Authorization": "Bearer sk-wrong", "x-request-id": "req-401"})
    assert refused.status_code == 401

    lines = wait_until(lambda: (lambda ls: ls if len(ls) >= 5 else None)(_access_lines(proxy)), 10, 0.05,
                       "five access-log lines")
    by_id = {line["request_id"]: line for line in lines}
    assert len(lines) == 5 and set(by_id) == {"req-plain", "req-wrong", "req-debug", "req-404", "req-401"}
    assert (by_id["req-401"]["status"], by_id["req-401"]["error"]) == (401, "invalid_api_key")
    ok = by_id["req-debug"]
    assert set(ok) >= {"ts", "request_id", "model", "worker", "policy", "status", "ttft_ms", "total_ms", "retries",
                       "migrations", "stream", "client"}
    assert (ok["model"], ok["worker"], ok["policy"], ok["status"], ok["retries"], ok["stream"], ok["client"]) == (
        "m1", asked.headers["x-kvroute-worker"], "kv_aware", 200, 0, False, "team-a")
    assert 0 <= ok["ttft_ms"] <= ok["total_ms"]
    assert (by_id["req-404"]["status"], by_id["req-404"]["worker"]) == (404, None)
    # No secret in the proxy's log: neither the client's key nor the admin token.
    text = proxy.log()
    assert CLIENT_KEY not in text and ADMIN not in text and "sk-wrong" not in text


def test_the_decision_header_is_short_and_safe_at_any_fleet_size():
    scores = {f"worker-{i}\r\nx-evil: 1": float(1000 - i) for i in range(1000)}
    line = explain("kv_cost", "lowest_cost", "worker-999", scores)
    assert line.endswith(b"\r\n") and line.count(b"\r\n") == 1 and len(line) < 1200
    assert b"(+992 more)" in line and line.decode("ascii")
    no_scores = explain("round_robin", "round_robin", "w-1", None)
    assert no_scores == b"x-kvroute-decision: policy=round_robin; reason=round_robin; chosen=w-1\r\n"


def test_who_may_ask_follows_the_control_planes_admin_rule():
    no_token = DebugGate(None, open_control_plane=False)
    assert not no_token.allows(b"127.0.0.1", None, None)  # loopback is no admin: a local page is on loopback
    assert not no_token.allows(b"10.1.2.3", None, None)
    assert DebugGate(None, open_control_plane=True).allows(b"10.1.2.3", None, None)
    with_token = DebugGate(ADMIN, open_control_plane=False)
    assert not with_token.allows(b"127.0.0.1", None, None)
    assert with_token.allows(b"10.1.2.3", f"Bearer {ADMIN}".encode(), None)
    assert with_token.allows(b"10.1.2.3", b"Bearer sk-other", ADMIN.encode())
    assert not with_token.allows(b"10.1.2.3", b"Bearer sk-other", b"guess")
