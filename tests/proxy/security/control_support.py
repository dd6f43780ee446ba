"""What the control-plane security tests share: an in-process proxy app with a stand-in fleet manager, callers
on or off loopback (the data plane's client-address header with the app's internal-hop secret,
proxy/security/peer.py), and the tokens and routes they use."""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import build_app
from proxy.config import parse_config
from proxy.fleet.api import add_fleet_routes
from proxy.security import peer

REMOTE = "203.0.113.7"        # TEST-NET-3: never a real peer; only ever a header value here
TRUSTED = "198.51.100.20"     # TEST-NET-2, listed in trusted_worker_networks below
ADMIN, WORKER_TOKEN = "adm1n-t0ken", "w0rker-t0ken"
TOKENS = f"proxy:\n  admin_token: {ADMIN}\n  worker_token: {WORKER_TOKEN}\n"
ADMIN_ROUTES = [("GET", "/fleet"), ("POST", "/fleet/scale"), ("POST", "/fleet/apply")]  # and drain/delete
READ_ROUTES = [("GET", "/workers"), ("GET", "/nodes/status")]  # admin, or a caller on this machine


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


async def start_proxy(clients: list[TestClient], config_text: str = "") -> Proxy:
    """A proxy app on a loopback test server with `config_text` (no environment read); its client into `clients`."""
    config = parse_config(config_text, env={})
    app = build_app(config)
    manager = FakeManager()
    add_fleet_routes(app, manager)  # type: ignore[arg-type]
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    clients.append(client)
    return Proxy(client, app, manager)
