"""The control plane is closed by default, and workers act only on themselves, LMDeploy's /nodes/add included
(issue 11, items 1 and 3). The allowlist, secrets and callers' addresses: test_control_network.py; real
processes: test_control_processes.py.

Callers "off loopback" arrive the way the data plane hands them to the aiohttp app: with the
client-address header and the app's internal-hop secret (proxy/security/peer.py). A header without
that secret is ignored, which is tested too.
"""

from __future__ import annotations

import base64
import os

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.app import REGISTRY_KEY
from proxy.protocol import STALE_AFTER_S
from proxy.security.controlauth import startup_problem
from proxy.workers.registry import TAKEOVER_AFTER_S
from tests.proxy.security.control_support import (
    ADMIN,
    ADMIN_ROUTES,
    READ_ROUTES,
    REMOTE,
    TOKENS,
    TRUSTED,
    WORKER_TOKEN,
)

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


