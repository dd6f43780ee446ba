"""The OpenAI surface the control-plane app serves: GET /v1/models.

Owns that route and the model list; /v1 completions are the data plane's alone (proxy/dataplane/), and
any other spelling of their path that reaches this app is an unknown route (404). The registry and the
live config say which models exist.
"""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from proxy.config import FleetConfig
from proxy.routing.live import LiveConfig
from proxy.workers.registry import Registry

CREATED = int(time.time())


def add_routes(app: web.Application, registry: Registry, live: LiveConfig) -> None:
    async def models(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({"object": "list", "data": list_models(registry, live.config)}),
                            content_type="application/json")

    app.router.add_get("/v1/models", models)


def list_models(registry: Registry, config: FleetConfig) -> list[dict[str, object]]:
    """Each model once: what workers serve plus what the config declares, then the aliases."""
    entries: dict[str, dict[str, object]] = {}
    served = registry.served_models()
    names = list(dict.fromkeys([*served, *(m.name for m in config.models)]))
    for name in names:
        workers = served.get(name, [])
        lengths = [w.max_model_len for w in workers if w.max_model_len]
        engines = sorted({w.engine for w in workers if w.engine != "unknown"})
        configured = config.model(name)
        owner = engines[0] if len(engines) == 1 else (configured.engine if configured else "kvroute")
        entries[name] = {"id": name, "object": "model", "created": CREATED, "owned_by": owner,
                         "root": name, "parent": None, "max_model_len": max(lengths) if lengths else None,
                         "workers": len(workers)}
    for model in config.models:
        for alias in model.aliases:
            if alias not in entries:
                target = entries.get(model.name, {})
                entries[alias] = {**target, "id": alias, "root": model.name, "parent": model.name}
    return list(entries.values())
