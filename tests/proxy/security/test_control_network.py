"""The control plane keeps worker URLs inside the allowlist, secrets out of logs and /workers, trusts a
forwarded caller address only with the internal-hop secret, and takes nothing from a web page (issue 11, items
5 and 7; issue 33, item 1)."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web
from aiohttp.test_utils import TestServer, make_mocked_request

from proxy.app import REGISTRY_KEY
from proxy.config import parse_config
from proxy.security import peer
from proxy.security.controlauth import presented_token
from proxy.security.redact import redact_argv, redact_text
from tests.proxy.security.control_support import (
    ADMIN,
    REMOTE,
    TOKENS,
    WORKER_TOKEN,
)
from tests.support.procs import free_port

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
