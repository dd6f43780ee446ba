"""A web page in a local browser cannot drive the control plane of a default `kvroute up` (issue 33, item 1).

The attack as it was found: a page served from another local origin POSTs to the proxy with the types a
browser sends without asking (text/plain, a form), and after DNS rebinding a page whose own name now
resolves to 127.0.0.1 calls the proxy as its "same origin". Run in a real headless Chromium against a real
`kvroute up` (sim workers: the control plane is the same for every engine); nothing may change: no worker
drained or registered, no replica started, the config file byte for byte the same, no command run.
"""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import httpx
import pytest

from tests.observability.cdp import Browser
from tests.support.procs import admin_headers, free_port, wait_until

MODEL = "tiny"
CONFIG = (f"models:\n  - name: {MODEL}\n    engine: sim\n    preset: cpu-tiny\n    device: cpu\n    replicas: 1\n"
          "    engine_args: {time-scale: 10}\n")

# What the page tries, each with a payload that would be visible if it worked.
ATTACK_JS = """
async (proxy, workerId, marker) => {
  const apply = "models:\\n  - name: pwn\\n    engine: sim\\n    device: cpu\\n    replicas: 1\\n" +
                "    env: {BROWSER: 'touch " + marker + "', PYTHONSTARTUP: '" + marker + "'}\\n";
  const registration = JSON.stringify({worker_id: "rogue", url: "http://127.0.0.1:9", models: ["tiny"]});
  const calls = [
    ["POST", "/workers/" + workerId + "/drain", "{}"],
    ["DELETE", "/workers/" + workerId, null],
    ["POST", "/workers", registration],
    ["POST", "/nodes/add", JSON.stringify({url: "http://127.0.0.1:9"})],
    ["POST", "/fleet/scale", JSON.stringify({model: "tiny", replicas: 3})],
    ["POST", "/fleet/apply", apply],
  ];
  const seen = [];
  for (const [method, path, body] of calls) {
    for (const type of ["text/plain", "application/x-www-form-urlencoded", "application/json"]) {
      for (const mode of ["no-cors", "cors"]) {
        try {
          const r = await fetch(proxy + path, {method, mode, body, headers: {"Content-Type": type}});
          seen.push(method + " " + path + " " + type + " " + mode + " -> " + r.status);
        } catch (e) {
          seen.push(method + " " + path + " " + type + " " + mode + " -> refused by the browser");
        }
      }
    }
  }
  // A plain HTML form, the oldest cross-site write there is.
  const form = document.createElement("form");
  form.method = "POST"; form.action = proxy + "/fleet/scale"; form.enctype = "text/plain"; form.target = "sink";
  const field = document.createElement("input");
  field.name = '{"model": "tiny", "replicas": 4, "x": "'; field.value = '"}';
  form.appendChild(field);
  const sink = document.createElement("iframe"); sink.name = "sink"; document.body.appendChild(sink);
  document.body.appendChild(form);
  const loaded = new Promise(ok => sink.addEventListener("load", ok));
  form.submit();
  await loaded;
  return seen;
}
"""

# After rebinding, the page's own origin is the proxy's port: same-origin fetches, JSON allowed.
REBOUND_JS = """
async (workerId) => {
  const out = {};
  for (const [method, path, body] of [
      ["GET", "/workers", null],
      ["POST", "/workers", JSON.stringify({worker_id: "rebound", url: "http://127.0.0.1:9", models: ["tiny"]})],
      ["POST", "/workers/" + workerId + "/drain", "{}"],
      ["POST", "/fleet/scale", JSON.stringify({model: "tiny", replicas: 5})]]) {
    const r = await fetch(path, {method, body, headers: body ? {"Content-Type": "application/json"} : {}});
    out[method + " " + path] = [r.status, await r.text()];
  }
  return out;
}
"""


class _AttackerSite:
    """Another local origin: a page of the attacker's, served on its own port."""

    def __init__(self) -> None:
        page = b"<!doctype html><title>cat pictures</title><body>nothing to see</body>"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _state(url: str, admin: dict[str, str]) -> tuple[list[tuple[str, str]], dict[str, int]]:
    workers = httpx.get(url + "/workers", headers=admin, timeout=5).json()["workers"]
    fleet = httpx.get(url + "/fleet", headers=admin, timeout=5).json()
    desired = {m["name"]: m["desired_replicas"] for m in fleet["models"]}
    return sorted((w["worker_id"], w["state"]) for w in workers), desired


@pytest.fixture
def default_fleet(procs, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = procs.kvroute("up", str(config), "--port", str(port), "--run-dir", str(tmp_path / "logs"), name="up")
    wait_until(lambda: httpx.get(url + "/ready", timeout=2).status_code == 200, 90, 0.2, "kvroute up to be ready")
    return url, config, up


def test_a_page_of_another_local_origin_changes_nothing_in_a_default_fleet(procs, tmp_path, default_fleet):
    url, config, up = default_fleet
    admin = admin_headers(url)
    before_config = config.read_bytes()
    workers_before, desired_before = _state(url, admin)
    (worker_id, _), = workers_before
    marker = tmp_path / "pwned"
    site = _AttackerSite()
    browser = Browser(procs, tmp_path / "chromium-profile")
    try:
        browser.open(site.url + "/")
        seen = browser.evaluate(f"({ATTACK_JS})({url!r}, {worker_id!r}, {str(marker)!r})")
    finally:
        browser.close()
        site.close()
    # Simple requests reach the proxy (opaque answers, status 0 to the page); the others die in the browser's
    # preflight. The proxy's log shows it saw and refused them.
    assert all(line.endswith(("-> 0", "-> refused by the browser")) for line in seen), seen
    assert sum(line.endswith("-> 0") for line in seen) >= 10, seen
    assert _state(url, admin) == (workers_before, desired_before)
    assert config.read_bytes() == before_config
    assert not marker.exists()
    assert "refused a cross-origin control request" in up.log()
    assert "pwn" not in up.log() and "rogue" not in up.log()


def test_after_dns_rebinding_a_page_can_neither_read_nor_change_the_control_plane(procs, tmp_path, default_fleet):
    url, config, up = default_fleet
    port = url.rsplit(":", 1)[1]
    admin = admin_headers(url)
    before_config = config.read_bytes()
    workers_before, desired_before = _state(url, admin)
    (worker_id, _), = workers_before
    # Chromium resolves the attacker's name to this machine: what a rebinding DNS server makes it do.
    browser = Browser(procs, tmp_path / "chromium-profile",
                      extra_args=("--host-resolver-rules=MAP rebind.attacker.test 127.0.0.1",))
    try:
        browser.open(f"http://rebind.attacker.test:{port}/dashboard")  # the public page loads as the attacker's
        out = browser.evaluate(f"({REBOUND_JS})({worker_id!r})")
    finally:
        browser.close()
    for call, (status, body) in out.items():
        assert status == 403, (call, status, body)
        assert "host_not_allowed" in body, (call, body)
    assert _state(url, admin) == (workers_before, desired_before)
    assert config.read_bytes() == before_config  # `scale` rewrites the file when it works


def test_the_dashboard_still_administers_with_the_admin_token(procs, tmp_path, default_fleet):
    url, config, _ = default_fleet
    token = admin_headers(url)["Authorization"].removeprefix("Bearer ")
    browser = Browser(procs, tmp_path / "chromium-profile")
    try:
        browser.open(url + "/dashboard")
        browser.evaluate("useToken('not-the-token')")
        assert browser.evaluate("document.body.classList.contains('admin')") is False
        browser.evaluate(f"window.confirm = () => true; useToken('{token}')")
        wait_until(lambda: browser.evaluate("document.body.classList.contains('admin')"), 10, 0.1, "admin mode")
        browser.evaluate("document.querySelector('button[data-drain]').click()")
        wait_until(lambda: [w["state"] for w in httpx.get(url + "/workers", timeout=5).json()["workers"]]
                   == ["draining"], 10, 0.1, "the worker drained from the page")
    finally:
        browser.close()
    assert Path(config).read_text() == CONFIG
