"""A stand-in engine for retry tests: answers like vLLM 0.32 does for an image URL it cannot reach.

`python -m tests.support.fake_engine PORT MODEL`: requests whose body mentions `unreachable.invalid` get vLLM's
HTTP 500 (aiohttp's connect error text); others a one-word completion. GET /hits counts chat requests.
"""

from __future__ import annotations

import sys
import time

from aiohttp import web

MEDIA_500 = {"error": {"message": "Cannot connect to host unreachable.invalid:80 ssl:default [Name or service not "
                                  "known]", "type": "InternalServerError", "param": None, "code": 500}}


def build(model: str) -> web.Application:
    hits = {"chat": 0, "media_failures": 0}

    async def chat(request: web.Request) -> web.Response:
        hits["chat"] += 1
        body = await request.read()
        if b"unreachable.invalid" in body:
            hits["media_failures"] += 1
            return web.json_response(MEDIA_500, status=500)
        return web.json_response({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def get_hits(request: web.Request) -> web.Response:
        return web.json_response(hits)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/hits", get_hits)
    return app


if __name__ == "__main__":
    web.run_app(build(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), print=None)
