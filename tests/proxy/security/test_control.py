"""The control plane is closed by default, workers act only on themselves, and worker URLs stay inside
the allowlist (issue 11, items 1, 3, 5, 7).

Callers "off loopback" arrive the way the data plane hands them to the aiohttp app: with the
client-address header and the app's internal-hop secret (proxy/security/peer.py). A header without
that secret is ignored, which is tested too.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from proxy.app import REGISTRY_KEY, build_app
from proxy.config import parse_config
from proxy.fleet.api import add_fleet_routes
from proxy.protocol import STALE_AFTER_S
from proxy.security import peer
from proxy.security.controlauth import presented_token, startup_problem
from proxy.security.redact import redact_argv, redact_text
from proxy.workers.registry import TAKEOVER_AFTER_S
from tests.support.procs import free_port, wait_until

REMOTE = "203.0.113.7"        # TEST-NET-3: never a real peer; only ever a header value here
TRUSTED = "198.51.100.20"     # TEST-NET-2, listed in trusted_worker_networks below
ADMIN, WORKER_TOKEN = "adm1n-t0ken", "w0rker-t0ken"


class FakeManager:
    """Stands in for the fleet manager: records what /fleet/* asked of it."""

    config_path = None  # no file to write a scale back to

    def __init__(self) -> None:
        self.applied: list[object] = []
        self.scaled: list[tuple[str, int]] = []

    def snapshot(self) -> dict[str, object]:
        return {"models": [], "replicas": []}

    def apply(self, config: object) -> dict[str, str]:
        self.applied.append(config)
        return {}

    def scale(self, model: str, replicas: int) -> dict[str, str]:
        self.scaled.append((model, replicas))
        return {model: f"scale to {replicas}"}


class Proxy:
    """An in-process proxy app plus helpers to call it as a given caller."""

    def __init__(self, client: TestClient, app: web.Application, manager: FakeManager) -> None:
        self.client, self.app, self.manager = client, app, manager

    def headers(self, token: str | None = None, source: str | None = None, **extra: str) -> dict[str, str]:
        h = dict(extra)
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        if source is not None:  # as the data plane forwards a caller from `source`
            h.update(dict(peer.hop_headers(self.app, source)))
        return h

    async def call(self, method: str, path: str, token: str | None = None, source: str | None = None,
                   **kwargs: object) -> tuple[int, object]:
        headers = {**self.headers(token, source), **kwargs.pop("headers", {})}  # type: ignore[dict-item]
        if "data" in kwargs:  # a config's text: control routes that change state take JSON's type only
            headers.setdefault("Content-Type", "application/json")
        async with self.client.request(method, path, headers=headers, **kwargs) as resp:
            body = await resp.json(content_type=None) if resp.content_type == "application/json" else None
            return resp.status, body

    async def register(self, worker_id: str, url: str, token: str | None = None, source: str | None = None,
                       headers: dict[str, str] | None = None, **extra: object) -> tuple[int, object]:
        return await self.call("POST", "/workers", token, source, headers=headers or {},
                               json={"worker_id": worker_id, "url": url, "models": ["m1"], **extra})

    def report_body(self, worker_id: str, url: str, seq: int, state: str = "ready") -> dict[str, object]:
        return {"worker_id": worker_id, "url": url, "models": ["m1"], "state": state, "kv_cache_usage": 0.1,
                "kv_capacity_tokens": 1000, "num_running": 0, "num_waiting": 0, "seq": seq, "sent_at": time.time()}


@pytest.fixture
async def make_proxy() -> AsyncIterator[Callable[..., object]]:
    clients: list[TestClient] = []

    async def start(config_text: str = "") -> Proxy:
        config = parse_config(config_text, env={})
        app = build_app(config)
        manager = FakeManager()
        add_fleet_routes(app, manager)  # type: ignore[arg-type]
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return Proxy(client, app, manager)

    yield start
    for client in clients:
        await client.close()


TOKENS = f"proxy:\n  admin_token: {ADMIN}\n  worker_token: {WORKER_TOKEN}\n"
ADMIN_ROUTES = [("GET", "/fleet"), ("POST", "/fleet/scale"), ("POST", "/fleet/apply")]  # and drain/delete
READ_ROUTES = [("GET", "/workers"), ("GET", "/nodes/status")]  # admin, or a caller on this machine


# --- 1. closed by default ----------------------------------------------------------------------------

async def test_without_an_admin_token_nobody_administers_and_only_loopback_callers_read(make_proxy):
    proxy = await make_proxy()
    for method, path in ADMIN_ROUTES + READ_ROUTES:
        status, body = await proxy.call(method, path, source=REMOTE, json={})
        assert status == 403, (method, path)
        assert body["error"]["code"] == "control_plane_closed"
        status, _ = await proxy.call(method, path, source=REMOTE, token="anything", json={})
        assert status == 403, (method, path)
    for method, path in ADMIN_ROUTES:  # on loopback too: a web page in a local browser is on loopback
        status, body = await proxy.call(method, path, json={})
        assert status == 403 and body["error"]["code"] == "control_plane_closed", (method, path)
    for method, path in READ_ROUTES:
        assert (await proxy.call(method, path))[0] == 200
        assert (await proxy.call(method, path, source="127.0.0.1"))[0] == 200
    # Anonymous remote callers neither register nor touch a worker.
    assert (await proxy.register("w", "http://127.0.0.1:9", source=REMOTE))[0] == 403
    assert (await proxy.call("POST", "/nodes/add", source=REMOTE, json={"url": "http://127.0.0.1:9"}))[0] == 403
    assert (await proxy.register("w", "http://127.0.0.1:9"))[0] == 200
    for method, path in [("POST", "/workers/w/drain"), ("DELETE", "/workers/w"), ("GET", "/workers/w")]:
        assert (await proxy.call(method, path, source=REMOTE))[0] == 403, (method, path)
        assert (await proxy.call(method, path, source=REMOTE, token="guess"))[0] == 401, (method, path)
    for method, path in [("POST", "/workers/w/drain"), ("DELETE", "/workers/w")]:
        assert (await proxy.call(method, path))[0] == 401, (method, path)  # loopback, no token
    assert (await proxy.call("GET", "/workers/w"))[0] == 200
    removal = {"url": "http://127.0.0.1:9"}
    assert (await proxy.call("POST", "/nodes/remove", source=REMOTE, json=removal))[0] == 403
    assert (await proxy.call("POST", "/nodes/remove", source=REMOTE, token="guess", json=removal))[0] == 401
    assert proxy.app[REGISTRY_KEY].get("w") is not None and not proxy.app[REGISTRY_KEY].get("w").drain_requested
    assert (await proxy.call("GET", "/health", source=REMOTE))[0] == 200  # not part of the control plane


async def test_anonymous_fleet_apply_and_scale_are_refused_off_loopback(make_proxy):
    proxy = await make_proxy()
    config = "models:\n  - name: evil\n    engine: sim\n    env: {VLLM_X: '1'}\n"
    status, _ = await proxy.call("POST", "/fleet/apply", source=REMOTE, data=config)
    assert status == 403
    status, _ = await proxy.call("POST", "/fleet/scale", source=REMOTE, json={"model": "m", "replicas": 5})
    assert status == 403
    assert proxy.manager.applied == [] and proxy.manager.scaled == []
    # With a token configured, loopback needs it too.
    tokened = await make_proxy(TOKENS)
    assert (await tokened.call("POST", "/fleet/apply", data=config))[0] == 401
    assert (await tokened.call("POST", "/fleet/apply", token=WORKER_TOKEN, data=config))[0] == 403
    assert (await tokened.call("POST", "/fleet/apply", token=ADMIN, source=REMOTE, data=config))[0] == 200
    assert len(tokened.manager.applied) == 1


async def test_http_applied_configs_do_not_read_the_proxys_environment_and_replicas_are_capped(make_proxy):
    proxy = await make_proxy(TOKENS)
    os.environ["KVROUTE_TEST_SECRET"] = "do-not-echo"
    try:
        status, body = await proxy.call("POST", "/fleet/apply", token=ADMIN,
                                        data="models:\n  - name: ${KVROUTE_TEST_SECRET}\n    engine: sim\n")
    finally:
        del os.environ["KVROUTE_TEST_SECRET"]
    assert status == 400 and "KVROUTE_TEST_SECRET is not set" in body["error"]["message"]
    assert "do-not-echo" not in str(body)
    status, _ = await proxy.call("POST", "/fleet/apply", token=ADMIN,
                                 data="models:\n  - name: ${NAME:-plain}\n    engine: sim\n")
    assert status == 200 and proxy.manager.applied[-1].models[0].name == "plain"
    status, body = await proxy.call("POST", "/fleet/scale", token=ADMIN, json={"model": "m", "replicas": 100000})
    assert status == 400 and body["error"]["code"] == "too_many_replicas"
    status, _ = await proxy.call("POST", "/fleet/apply", token=ADMIN,
                                 data="models:\n  - name: a\n    engine: sim\n    replicas: 5000\n")
    assert status == 400 and proxy.manager.scaled == []


@pytest.mark.parametrize("route", ADMIN_ROUTES + READ_ROUTES)
async def test_each_admin_route_with_and_without_each_credential(make_proxy, route):
    proxy = await make_proxy(TOKENS)
    method, path = route
    assert (await proxy.call(method, path, json={}))[0] == (200 if route in READ_ROUTES else 401)
    assert (await proxy.call(method, path, source=REMOTE, json={}))[0] == 401
    assert (await proxy.call(method, path, token="wrong", json={}))[0] == 401
    assert (await proxy.call(method, path, token="wrong", source=REMOTE, json={}))[0] == 401
    assert (await proxy.call(method, path, token=WORKER_TOKEN, json={}))[0] == 403
    status, body = await proxy.register("w1", "http://127.0.0.1:9", token=WORKER_TOKEN)
    assert (await proxy.call(method, path, token=body["worker_secret"], json={}))[0] in (403, 401)
    assert (await proxy.call(method, path, token=ADMIN, json={}))[0] not in (401, 403)
    assert (await proxy.call(method, path, token=ADMIN, source=REMOTE, json={}))[0] not in (401, 403)


async def test_an_empty_admin_token_counts_as_unset(make_proxy):
    proxy = await make_proxy('proxy:\n  admin_token: ""\n')
    assert (await proxy.call("GET", "/workers"))[0] == 200
    assert (await proxy.call("POST", "/fleet/scale", json={"model": "m", "replicas": 1}))[0] == 403
    assert (await proxy.call("GET", "/workers", source=REMOTE, token=""))[0] == 403
    assert startup_problem("0.0.0.0", "  ", False)[0] is False


# --- 2. least-privilege workers ----------------------------------------------------------------------

async def test_registration_returns_a_secret_that_alone_acts_on_that_worker(make_proxy):
    proxy = await make_proxy(TOKENS)
    assert (await proxy.register("a", "http://127.0.0.1:9001"))[0] == 401  # no token, loopback
    status, a = await proxy.register("a", "http://127.0.0.1:9001", token=WORKER_TOKEN, source=REMOTE)
    assert status == 200 and a["worker_secret"]
    _, b = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN, source=REMOTE)
    sa, sb = a["worker_secret"], b["worker_secret"]
    assert sa != sb

    report = proxy.report_body("a", "http://127.0.0.1:9001", 1)
    assert (await proxy.call("POST", "/workers/a/report", json=report))[0] == 401
    assert (await proxy.call("POST", "/workers/a/report", token=WORKER_TOKEN, json=report))[0] == 403
    assert (await proxy.call("POST", "/workers/a/report", token=sb, json=report))[0] == 403
    assert (await proxy.call("POST", "/workers/a/report", token=sa, source=REMOTE, json=report))[0] == 200
    # A's secret does not reach B: no drain, delete, forged report, or re-registration elsewhere.
    forged = proxy.report_body("b", "http://127.0.0.1:9002", 10**12, state="failed")
    assert (await proxy.call("POST", "/workers/b/report", token=sa, json=forged))[0] == 403
    assert (await proxy.call("POST", "/workers/b/drain", token=sa))[0] == 403
    assert (await proxy.call("DELETE", "/workers/b", token=sa))[0] == 403
    assert (await proxy.call("GET", "/workers/b", token=sa))[0] == 403
    assert (await proxy.call("POST", "/nodes/remove", token=sa, json={"url": "http://127.0.0.1:9002"}))[0] == 403
    registry = proxy.app[REGISTRY_KEY]
    worker_b = registry.get("b")
    assert worker_b is not None and not worker_b.drain_requested and worker_b.reported_state == "ready"
    # The worker token cannot touch an existing worker either.
    assert (await proxy.call("POST", "/workers/b/drain", token=WORKER_TOKEN))[0] == 403
    assert (await proxy.call("DELETE", "/workers/b", token=WORKER_TOKEN))[0] == 403
    # Each acts on itself; the admin on anyone.
    assert (await proxy.call("POST", "/workers/a/drain", token=sa))[0] == 200
    assert (await proxy.call("DELETE", "/workers/a", token=sa))[0] == 200
    assert (await proxy.call("DELETE", "/workers/a", token=sa))[0] == 401  # gone: a reporter registers again
    assert (await proxy.call("POST", "/workers/b/drain", token=ADMIN))[0] == 200


async def test_no_credential_tells_a_registered_worker_id_from_an_unknown_one(make_proxy):
    # Issue 33, item 10: with any token, GET /workers/ID (and drain, delete, report) answered 401 for a
    # registered id and 404 otherwise; a caller could enumerate the fleet's ids.
    proxy = await make_proxy(TOKENS)
    _, b = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN)
    _, a = await proxy.register("a", "http://127.0.0.1:9001", token=WORKER_TOKEN)
    routes = [("GET", "/workers/{}"), ("POST", "/workers/{}/drain"), ("DELETE", "/workers/{}"),
              ("POST", "/workers/{}/report")]
    for token in ("junk", WORKER_TOKEN, a["worker_secret"], None):
        for source in (None, REMOTE):
            for method, path in routes:
                if token is None and source is None and method == "GET":
                    continue  # this machine reads without a token: it may list every worker anyway
                known = await proxy.call(method, path.format("b"), token, source, json={})
                unknown = await proxy.call(method, path.format("nobody"), token, source, json={})
                assert known == unknown and known[0] in (401, 403), (token, source, method, path, known, unknown)
    for url in ("http://127.0.0.1:9002", "http://127.0.0.1:9099"):  # /nodes/remove by URL: the same
        assert (await proxy.call("POST", "/nodes/remove", "junk", json={"url": url}))[0] == 401
    assert (await proxy.call("GET", "/workers/nobody", ADMIN))[0] == 404  # the admin is told the truth
    assert (await proxy.call("GET", "/workers/b", ADMIN))[0] == 200


async def test_a_live_worker_cannot_be_replaced_by_id_or_url(make_proxy):
    proxy = await make_proxy(TOKENS)
    _, b = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN)
    await proxy.call("POST", "/workers/b/report", token=b["worker_secret"],
                     json=proxy.report_body("b", "http://127.0.0.1:9002", 1))
    # Same id, attacker's URL; same URL, another id: both 409, and B keeps its URL and traffic.
    status, body = await proxy.register("b", "http://127.0.0.1:6666", token=WORKER_TOKEN)
    assert status == 409 and body["error"]["code"] == "worker_conflict"
    assert (await proxy.register("evil", "http://127.0.0.1:9002", token=WORKER_TOKEN))[0] == 409
    _, a = await proxy.register("a", "http://127.0.0.1:9001", token=WORKER_TOKEN)
    assert (await proxy.register("b", "http://127.0.0.1:6666", token=a["worker_secret"]))[0] == 403
    registry = proxy.app[REGISTRY_KEY]
    assert registry.get("b").url == "http://127.0.0.1:9002" and registry.get("evil") is None
    # /nodes/add with B's URL does not evict it either (no probe needed to refuse).
    status, _ = await proxy.call("POST", "/nodes/add", token=WORKER_TOKEN, json={"url": "http://127.0.0.1:9002"})
    assert status == 409 and registry.get("b") is not None
    # The owner may register again (a new secret); the admin may replace anyone.
    status, again = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN,
                                         headers={"x-kvroute-worker-secret": b["worker_secret"]})
    assert status == 200 and again["worker_secret"] != b["worker_secret"]
    assert (await proxy.register("b", "http://127.0.0.1:9003", token=ADMIN))[0] == 200


async def test_a_silent_worker_may_be_taken_over_after_a_while(make_proxy):
    proxy = await make_proxy(TOKENS)
    _, b = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN)
    registry = proxy.app[REGISTRY_KEY]
    registry.get("b").registered_mono -= TAKEOVER_AFTER_S + 5  # silent since long before now
    status, _ = await proxy.register("b", "http://127.0.0.1:9012", token=WORKER_TOKEN)
    assert status == 200 and registry.get("b").url == "http://127.0.0.1:9012"
    old = proxy.report_body("b", "http://127.0.0.1:9002", 1)
    assert (await proxy.call("POST", "/workers/b/report", token=b["worker_secret"], json=old))[0] == 401


async def test_a_restarted_worker_takes_back_its_own_id_and_url_once_it_went_stale(make_proxy):
    proxy = await make_proxy(TOKENS)
    _, b = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN)
    registry = proxy.app[REGISTRY_KEY]
    await proxy.call("POST", "/workers/b/report", token=b["worker_secret"],
                     json=proxy.report_body("b", "http://127.0.0.1:9002", 1))
    # Killed: its last report is older than the stale window, but not the takeover delay.
    registry.get("b").load.reading_at -= STALE_AFTER_S + 0.5
    assert not registry.get("b").replaceable(registry.clock())
    # Its restart lost the secret; same id and URL is no hijack, so it is taken back at once...
    status, again = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN)
    assert status == 200 and again["worker_secret"] != b["worker_secret"]
    # ...but the same stale entry is still not given to another URL before the delay.
    registry.get("b").load.reading_at = None
    registry.get("b").registered_mono -= STALE_AFTER_S + 0.5
    assert (await proxy.register("b", "http://127.0.0.1:6666", token=WORKER_TOKEN))[0] == 409


async def test_a_forged_report_cannot_make_genuine_reports_look_old(make_proxy):
    proxy = await make_proxy(TOKENS)
    _, b = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN)
    forged = proxy.report_body("b", "http://127.0.0.1:9002", 10**15, state="failed")
    for token in (None, WORKER_TOKEN, "guess"):
        assert (await proxy.call("POST", "/workers/b/report", token=token, json=forged))[0] in (401, 403)
    genuine = proxy.report_body("b", "http://127.0.0.1:9002", 1)
    assert (await proxy.call("POST", "/workers/b/report", token=b["worker_secret"], json=genuine))[0] == 200
    worker = proxy.app[REGISTRY_KEY].get("b")
    assert worker.reported_state == "ready" and worker.last_report.seq == 1
    # A new registration (a restarted worker) starts its own sequence.
    _, again = await proxy.register("b", "http://127.0.0.1:9002", token=WORKER_TOKEN,
                                    headers={"x-kvroute-worker-secret": b["worker_secret"]})
    assert (await proxy.call("POST", "/workers/b/report", token=again["worker_secret"], json=genuine))[0] == 200
    assert proxy.app[REGISTRY_KEY].get("b").last_report.seq == 1


async def test_without_a_worker_token_loopback_registers_anonymously_and_still_gets_a_secret(make_proxy):
    proxy = await make_proxy(f"proxy:\n  admin_token: {ADMIN}\n")
    status, a = await proxy.register("a", "http://127.0.0.1:9001")
    assert status == 200 and a["worker_secret"]
    assert (await proxy.register("x", "http://127.0.0.1:9005", source=REMOTE))[0] == 401
    report = proxy.report_body("a", "http://127.0.0.1:9001", 1)
    assert (await proxy.call("POST", "/workers/a/report", json=report))[0] == 401
    assert (await proxy.call("POST", "/workers/a/report", token=a["worker_secret"], json=report))[0] == 200


# --- LMDeploy's /nodes/add ------------------------------------------------------------------------------

async def test_lmdeploy_registers_from_a_trusted_network_or_with_the_token_in_its_proxy_url(make_proxy):
    async def list_models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m1"}]})

    models = web.Application()
    models.router.add_get("/v1/models", list_models)
    server = TestServer(models, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await make_proxy(TOKENS + "  trusted_worker_networks: [198.51.100.0/24]\n")
        url = f"http://127.0.0.1:{server.port}"
        body = {"url": url, "status": {"models": ["m1"], "role": "Hybrid"}}
        assert (await proxy.call("POST", "/nodes/add", source=REMOTE, json=body))[0] == 401
        status, added = await proxy.call("POST", "/nodes/add", source=TRUSTED, json=body)
        assert status == 200 and added["message"] == "Added successfully"
        # LMDeploy re-announcing itself (a restart) is fine, and does not undo an operator's drain.
        assert (await proxy.call("POST", f"/workers/{added['worker_id']}/drain", token=ADMIN))[0] == 200
        assert (await proxy.call("POST", "/nodes/add", source=TRUSTED, json=body))[0] == 200
        assert proxy.app[REGISTRY_KEY].get(added["worker_id"]).drain_requested
        # `--proxy-url http://kvroute:TOKEN@proxy:port`: requests sends the userinfo as Basic auth.
        basic = "Basic " + base64.b64encode(f"kvroute:{WORKER_TOKEN}".encode()).decode()
        status, latest = await proxy.call("POST", "/nodes/add", source=REMOTE, json={"url": url, "status": {}},
                                          headers={"Authorization": basic})
        assert status == 200
        assert (await proxy.call("POST", "/nodes/remove", source=TRUSTED, json={"url": url}))[0] == 403
        old_secret = added["worker_secret"]  # replaced by each re-announce
        assert (await proxy.call("POST", "/nodes/remove", token=old_secret, json={"url": url}))[0] == 401
        assert (await proxy.call("POST", "/nodes/remove", token=latest["worker_secret"], json={"url": url}))[0] == 200
        assert (await proxy.call("POST", "/nodes/remove", token=ADMIN, json={"url": url}))[0] == 404
    finally:
        await server.close()


# --- 3. address allowlist -------------------------------------------------------------------------------

async def test_a_url_outside_the_allowlist_is_refused_without_a_probe(make_proxy):
    hits: list[str] = []

    async def count(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"data": [{"id": "m1"}]})

    counting = web.Application()
    counting.router.add_route("*", "/{tail:.*}", count)
    server = TestServer(counting, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await make_proxy("proxy:\n  worker_networks: [10.0.0.0/8]\n")
        url = f"http://127.0.0.1:{server.port}"
        status, body = await proxy.call("POST", "/nodes/add", json={"url": url})
        assert status == 403 and body["error"]["code"] == "url_not_allowed"
        status, _ = await proxy.register("w", url)
        assert status == 403
        for bad in (url + "/?x=1", f"http://user:pw@127.0.0.1:{server.port}", url + "#frag"):
            assert (await proxy.call("POST", "/nodes/add", json={"url": bad}))[0] == 400
        await asyncio.sleep(0.3)  # the monitor would have scraped a registered worker by now
        assert hits == [] and len(proxy.app[REGISTRY_KEY]) == 0
    finally:
        await server.close()


async def test_the_default_allowlist_refuses_public_addresses_and_the_proxy_itself(make_proxy):
    proxy = await make_proxy()
    assert (await proxy.register("w", "http://203.0.113.9:8000"))[0] == 403
    assert (await proxy.register("w", "http://[2001:db8::1]:8000"))[0] == 403
    own = f"http://127.0.0.1:{proxy.client.server.port}"
    status, body = await proxy.register("w", own)
    assert status == 403 and "own address" in body["error"]["message"]
    assert (await proxy.register("w", f"http://localhost:{proxy.client.server.port}"))[0] == 403
    assert (await proxy.register("w", "http://10.1.2.3:8000"))[0] == 200  # private: allowed by default


async def test_a_probe_does_not_follow_redirects_and_its_error_says_nothing_of_the_port(make_proxy):
    hits: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        hits.append(request.path)
        raise web.HTTPFound("/elsewhere")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", redirect)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await make_proxy()
        status, redirected = await proxy.call("POST", "/nodes/add", json={"url": f"http://127.0.0.1:{server.port}"})
        closed = free_port()
        _, refused = await proxy.call("POST", "/nodes/add", json={"url": f"http://127.0.0.1:{closed}"})
        assert status == 400 and hits == ["/v1/models"]  # not /elsewhere
        assert redirected["error"]["message"] == refused["error"]["message"]
        assert str(closed) not in refused["error"]["message"]
    finally:
        await server.close()


# --- 4. secrets out of logs and /workers ---------------------------------------------------------------

async def test_workers_listing_shows_no_secret_and_bad_utf8_credentials_never_500(make_proxy):
    proxy = await make_proxy(TOKENS)
    status, reg = await proxy.register("a", "http://127.0.0.1:9001", token=WORKER_TOKEN, api_key="engine-key-123",
                                       labels={"hf_token": "hf_secret_value", "zone": "a"})
    assert status == 200
    text = str((await proxy.call("GET", "/workers", token=ADMIN))[1])
    for secret in ("engine-key-123", "hf_secret_value", reg["worker_secret"], WORKER_TOKEN):
        assert secret not in text
    assert "'zone': 'a'" in text and proxy.app[REGISTRY_KEY].get("a").api_key == "engine-key-123"

    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.client.server.port)
    writer.write(b"GET /workers HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\xc3(\r\nConnection: close\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert presented_token("Basic !!!notbase64") is None and presented_token("Bearer \udcff") == b"\xff"


def test_redaction_masks_keys_tokens_and_url_passwords_but_not_counts():
    argv = ["vllm", "serve", "--api-key", "sk-1", "--hf-token=hf_2", "--api-keys", "k1", "k2", "--port", "8",
            "--max-num-batched-tokens", "512", "--proxy-url", "http://u:pw@h:1"]
    shown = " ".join(redact_argv(argv))
    for secret in ("sk-1", "hf_2", "k1", "k2", "pw"):
        assert secret not in shown
    assert "--port 8" in shown and "--max-num-batched-tokens 512" in shown
    assert redact_text("Authorization: Bearer abc.def") .count("abc") == 0
    assert redact_text("kv_capacity_tokens=5 admin_token=xyz") == "kv_capacity_tokens=5 admin_token=***"


# --- the caller's address ----------------------------------------------------------------------------

def _request(app: web.Application, peer_addr: tuple[str, int], headers: dict[str, str]) -> web.Request:
    class Transport:
        def get_extra_info(self, name: str, default: object = None) -> object:
            return {"peername": peer_addr, "sockname": ("127.0.0.1", 1)}.get(name, default)

        def is_closing(self) -> bool:
            return False

    return make_mocked_request("GET", "/workers", headers=headers, app=app, transport=Transport())


def test_client_host_trusts_the_forwarded_address_only_with_the_hop_secret():
    app = web.Application()
    peer.install(app)
    spoofed = {peer.CLIENT_ADDR_HEADER: "127.0.0.1"}
    assert peer.client_host(_request(app, (REMOTE, 5555), spoofed)) == REMOTE  # a client's own copy: ignored
    wrong = {**spoofed, peer.HOP_SECRET_HEADER: "guess"}
    assert peer.client_host(_request(app, (REMOTE, 5555), wrong)) == REMOTE
    forwarded = dict(peer.hop_headers(app, REMOTE))
    assert peer.client_host(_request(app, ("127.0.0.1", 5555), forwarded)) == REMOTE
    assert peer.is_loopback("::ffff:127.0.0.1") and not peer.is_loopback("") and not peer.is_loopback(REMOTE)


async def test_a_direct_non_loopback_peer_is_refused(make_proxy):
    """Through the app's middleware with a real remote peer address (no headers at all)."""
    proxy = await make_proxy()
    handler_called: list[bool] = []

    async def handler(request: web.Request) -> web.Response:
        handler_called.append(True)
        return web.json_response({})

    from proxy.api.control import auth_middleware

    middleware = auth_middleware(parse_config("", env={}).proxy)
    request = _request(proxy.app, (REMOTE, 5555), {peer.CLIENT_ADDR_HEADER: "127.0.0.1"})
    response = await middleware(request, handler)
    assert response.status == 403 and handler_called == []
    local = await middleware(_request(proxy.app, ("127.0.0.1", 5555), {}), handler)
    assert local.status == 200 and handler_called == [True]


# --- start-up -----------------------------------------------------------------------------------------

def test_kvroute_proxy_refuses_a_non_loopback_bind_without_a_token(procs):
    refused = procs.kvroute("proxy", "--host", "0.0.0.0", "--port", "0", name="open-proxy",
                            env={"KVROUTE_ADMIN_TOKEN": ""})
    assert refused.popen.wait(30) == 2
    log = refused.log()
    assert "refusing to listen on 0.0.0.0 with an open control plane" in log and "listening" not in log

    port = free_port()
    insecure = procs.kvroute("proxy", "--host", "0.0.0.0", "--port", str(port), "--insecure-open-control-plane",
                             name="insecure-proxy", env={"KVROUTE_ADMIN_TOKEN": ""})
    wait_until(lambda: "listening" in insecure.log(), 30, what="the insecure proxy to start")
    assert "WARNING: --insecure-open-control-plane" in insecure.log()
    insecure.stop()

    tokened = procs.kvroute("proxy", "--host", "0.0.0.0", "--port", str(free_port()), name="tokened-proxy",
                            env={"KVROUTE_ADMIN_TOKEN": "s3cret"})
    wait_until(lambda: "listening" in tokened.log(), 30, what="the proxy with a token to start")
    assert "WARNING" not in tokened.log()


def test_kvroute_up_off_loopback_generates_a_private_token_that_status_finds(procs, tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text("proxy:\n  log_level: info\nmodels: []\n")
    port = free_port()
    env = {"KVROUTE_CONFIG_DIR": str(tmp_path / "cfg"), "KVROUTE_ADMIN_TOKEN": ""}
    up = procs.kvroute("up", str(config), "--host", "0.0.0.0", "--port", str(port), "--no-watch",
                       "--ready-timeout-s", "1", name="up", env=env)
    token_file = tmp_path / "cfg" / f"admin-token-{port}"
    wait_until(lambda: "ready" in up.log() or "not every worker" in up.log(), 60, what="kvroute up to start")
    assert str(token_file) in up.log()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in up.log()

    import subprocess

    from tests.support.procs import KVROUTE
    run_env = {**os.environ, **env}
    status = subprocess.run([*KVROUTE, "status", "--proxy", f"http://127.0.0.1:{port}"], capture_output=True,
                            text=True, timeout=60, env=run_env)
    assert status.returncode == 0, status.stderr
    other = subprocess.run([*KVROUTE, "scale", "m", "1", "--proxy", f"http://127.0.0.1:{port}"], capture_output=True,
                           text=True, timeout=60, env={**run_env, "KVROUTE_CONFIG_DIR": str(tmp_path / "none")})
    assert other.returncode == 1 and "admin token" in other.stderr


# --- a real worker process ------------------------------------------------------------------------------

def test_a_sim_worker_registers_with_the_worker_token_then_reports_and_leaves_with_its_own_secret(fleet, procs):
    import httpx

    fleet.start_proxy(config=TOKENS)
    port = free_port()
    sim = procs.kvroute("worker", "--engine", "sim", "--port", str(port), "--served-model-name", "m1",
                        "--time-scale", "20", "--proxy-url", fleet.url, "--worker-id", "sim-a", name="sim-a",
                        env={"KVROUTE_WORKER_TOKEN": WORKER_TOKEN})
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def reporting() -> dict | None:
        w = httpx.get(f"{fleet.url}/workers/sim-a", headers=admin, timeout=5).json()
        return w if w.get("state") == "ready" and (w.get("last_report") or {}).get("seq", 0) >= 3 else None

    wait_until(reporting, 30, 0.1, "sim-a to register and report with its secret")
    assert "report rejected" not in sim.log()
    sim.stop()  # SIGTERM: drain, then DELETE /workers/sim-a with its secret
    assert httpx.get(f"{fleet.url}/workers/sim-a", headers=admin, timeout=5).status_code == 404


def test_the_worker_gives_its_engine_a_key_of_its_own_and_keeps_one_the_operator_gave():
    from backends.worker import engine_api_key

    key, args, env = engine_api_key("vllm", ["--max-num-seqs", "8"], {})
    assert args == [] and env == {"VLLM_API_KEY": key} and len(key) >= 24  # env: not visible in `ps`
    other, _, _ = engine_api_key("vllm", [], {})
    assert other != key
    key, args, env = engine_api_key("turbomind", [], {})
    assert args == ["--api-keys", key] and env == {}
    assert engine_api_key("vllm", ["--api-key", "mine"], {}) == ("mine", [], {})
    assert engine_api_key("vllm", [], {"VLLM_API_KEY": "env-key"}) == ("env-key", [], {})
    assert engine_api_key("turbomind", ["--api-keys=given"], {})[0] == "given"


# --- real non-loopback callers: hosts as network namespaces on a private bridge ---------------------------

def test_callers_on_other_hosts_get_no_control_plane_without_credentials_even_when_spoofing(procs, tmp_path):
    import json
    import sys

    import httpx

    from tests.support.netns import ROOT_ADDRESS, namespaces_error, network
    from tests.support.procs import wait_http_ok

    if (why := namespaces_error()) is not None:
        pytest.fail(why)  # as tests/multihost does: real namespaces are part of the test
    config = tmp_path / "proxy.yaml"
    config.write_text(TOKENS + f"  trusted_worker_networks: [{ROOT_ADDRESS}/32]\n")
    with network(procs, ["a", "b"]) as net:
        a, b = net["a"], net["b"]
        a.kvroute("proxy", "--host", "0.0.0.0", "--port", "8000", "--config", str(config), name="proxy")
        url = a.url(8000)
        wait_http_ok(url + "/health", timeout=30)
        # B claims to be the trusted root address; the data plane replaces the claim with B's own.
        spoof = {peer.CLIENT_ADDR_HEADER: ROOT_ADDRESS, peer.HOP_SECRET_HEADER: "guess"}
        with httpx.Client(timeout=10) as http:  # this process: 10.203.0.1, trusted for registration only
            assert http.get(url + "/workers").status_code == 403  # known, but not an admin
            assert http.get(url + "/workers", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
            nothing_there = http.post(url + "/nodes/add", json={"url": f"http://{b.address}:9"})
            assert nothing_there.status_code == 400  # trusted: past auth, to a probe that finds nothing
            assert nothing_there.json()["error"]["code"] == "worker_unreachable"
            assert http.post(url + "/fleet/scale", json={"model": "m", "replicas": 1}).status_code == 403
        script = (f"import httpx, json; u = {url!r}; s = {json.dumps(spoof)!r}\n"
                  "out = [httpx.get(u + '/workers').status_code,\n"
                  f"       httpx.post(u + '/nodes/add', json={{'url': {b.url(9)!r}}}, headers=json.loads(s)).status_code,\n"
                  f"       httpx.post(u + '/workers', json={{'url': {b.url(9)!r}, 'models': ['m']}},\n"
                  f"                  headers={{'Authorization': 'Bearer {WORKER_TOKEN}'}}).status_code]\n"
                  "print(json.dumps(out))")
        result = b.run([sys.executable, "-c", script])
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1]) == [401, 401, 200]


# --- nothing from a web page (issue 33, item 1; the browser itself: test_security_browser.py) -----------

async def test_pages_of_other_origins_and_non_json_bodies_are_refused_even_with_the_admin_token(make_proxy):
    proxy = await make_proxy(TOKENS)
    scale = '{"model": "m", "replicas": 2}'
    for origin in ("http://127.0.0.1:3000", "http://evil.example", "null", "http://localhost"):
        status, body = await proxy.call("POST", "/fleet/scale", token=ADMIN, data=scale, headers={"Origin": origin})
        assert status == 403 and body["error"]["code"] == "cross_origin_refused", origin
    for site in ("cross-site", "same-site"):
        status, _ = await proxy.call("POST", "/fleet/scale", token=ADMIN, data=scale,
                                     headers={"Sec-Fetch-Site": site})
        assert status == 403, site
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        status, body = await proxy.call("POST", "/fleet/scale", token=ADMIN, data=scale,
                                        headers={"Content-Type": kind})
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", kind
    assert proxy.manager.scaled == []
    # The dashboard's own page (same origin, JSON) administers.
    host = f"127.0.0.1:{proxy.client.server.port}"
    status, _ = await proxy.call("POST", "/fleet/scale", token=ADMIN, data=scale,
                                 headers={"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"})
    assert status == 200 and proxy.manager.scaled == [("m", 2)]


async def test_without_a_credential_the_host_must_name_this_proxy(make_proxy):
    proxy = await make_proxy(TOKENS)
    for host in ("rebind.attacker.test", "rebind.attacker.test:8000", "203.0.113.9", "[2001:db8::1]:80", "a b"):
        status, body = await proxy.call("GET", "/workers", headers={"Host": host})
        assert status == 403 and body["error"]["code"] == "host_not_allowed", host
        assert (await proxy.register("w", "http://127.0.0.1:9", headers={"Host": host}))[0] == 403
    for host in ("127.0.0.1", "localhost:1", "[::1]:5", socket.gethostname()):
        assert (await proxy.call("GET", "/workers", headers={"Host": host}))[0] == 200, host
    # A token is what a page cannot have: behind a load balancer's name a worker with it still registers.
    status, _ = await proxy.register("w", "http://127.0.0.1:9", token=WORKER_TOKEN,
                                     headers={"Host": "kvroute.svc.cluster.local"})
    assert status == 200
    named = await make_proxy(TOKENS + "  allowed_hosts: [kvroute.internal]\n")
    assert (await named.call("GET", "/workers", headers={"Host": "kvroute.internal:8000"}))[0] == 200


async def test_fleet_apply_refuses_env_that_changes_what_runs(make_proxy):
    proxy = await make_proxy(TOKENS)
    for name in ("BROWSER", "PYTHONSTARTUP", "PYTHONPATH", "LD_PRELOAD", "PATH", "BASH_ENV", "VLLM_PLUGINS",
                 "VLLM_LOGGING_CONFIG_PATH", "NODE_OPTIONS", "vllm_lower"):
        config = f"models:\n  - name: a\n    engine: sim\n    env: {{{name}: x}}\n"
        status, body = await proxy.call("POST", "/fleet/apply", token=ADMIN, data=config)
        assert status == 400 and name in body["error"]["message"], name
    assert proxy.manager.applied == []
    allowed = "models:\n  - name: a\n    engine: sim\n    env: {VLLM_CPU_OMP_THREADS_BIND: all, HF_HUB_OFFLINE: '1'}\n"
    assert (await proxy.call("POST", "/fleet/apply", token=ADMIN, data=allowed))[0] == 200
