"""The tokenizer hand-over: `POST /workers/{worker_id}/tokenizer`, a worker giving the proxy its model's tokenizer.

Owns the route and its answers. The caller is that worker (its own secret) or an admin: control.py's middleware
checks every /workers/{id}/... route. What a bundle is: proxy/tokens/bundle.py; keeping tokenizers (one per
model, a bounded number, loaded off the event loop): proxy/routing/tokenizer_store.py.

Body `{"sha256": HEX}`: `{"have": true}` when the proxy holds that tokenizer (now bound to the worker's models),
else `{"have": false}`: send it again with `"bundle"` (bundle.py's wire form).
"""

from __future__ import annotations

import logging
import re

import orjson
from aiohttp import web

from proxy.errors import error_response
from proxy.routing.tokenizer_store import TokenizerLimit, TokenizerStore
from proxy.tokens.bundle import BundleError
from proxy.workers.registry import Registry

log = logging.getLogger("kvroute.tokens")

_SHA256 = re.compile(r"[0-9a-f]{64}")


def add_routes(app: web.Application, registry: Registry, store: TokenizerStore) -> None:
    async def hand_over(request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        worker = registry.get(worker_id)
        if worker is None:
            return error_response(404, f"No worker `{worker_id}` is registered.", code="worker_not_found")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        sha = body.get("sha256") if isinstance(body, dict) else None
        wire = body.get("bundle") if isinstance(body, dict) else None
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha) or not (wire is None or isinstance(wire, str)):
            return error_response(400, "The body must be {\"sha256\": 64 lowercase hex digits, \"bundle\": "
                                       "optional string}.", param="sha256")
        try:
            have = await store.adopt(sha, list(worker.models), wire)
        except BundleError as exc:
            log.warning("tokenizer from %s refused: %s", worker_id, exc)
            return error_response(400, f"The tokenizer bundle was refused: {exc}.", param="bundle",
                                  code="invalid_tokenizer")
        except TokenizerLimit as exc:
            log.warning("tokenizer from %s refused: %s", worker_id, exc)
            return error_response(409, f"{exc}; this one is not kept.", code="tokenizer_limit")
        if have and wire is not None:
            log.info("tokenizer %s from %s counts prompts for %s", sha[:12], worker_id, ",".join(worker.models))
        return web.Response(body=orjson.dumps({"have": have, "models": list(worker.models) if have else []}),
                            content_type="application/json")

    app.router.add_post("/workers/{worker_id}/tokenizer", hand_over)
