"""GET /openapi.json: the OpenAPI 3.1 document of the proxy's HTTP API (OpenAI surface, ops, control plane).

Owns the document only; worker payload schemas come from proxy/protocol.py's models, so the
document cannot drift from what the control plane validates. It describes; it enforces nothing.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic.json_schema import models_json_schema

from proxy.protocol import LoadReport, RegistrationAccepted, WorkerRegistration

_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {"description": description or "JSON", "content": {"application/json": {"schema": schema}}}


_ERROR = _json(_ref("Error"), "OpenAI-style error")
_ERRORS = {code: _ERROR for code in ("400", "401", "403", "404", "408", "413", "429", "431", "503")}
_BEARER = [{"bearer": []}, {}]  # a key when keys / tokens are configured; open otherwise

_CONTENT_PART = {
    "type": "object", "required": ["type"],
    "properties": {
        "type": {"type": "string", "examples": ["text", "image_url", "video_url"]},
        "text": {"type": "string"},
        "image_url": {"type": "object", "properties": {"url": {"type": "string"}}},
        "video_url": {"type": "object", "properties": {"url": {"type": "string"}}},
    },
}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "examples": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ref("ContentPart")}, {"type": "null"}]},
        "name": {"type": "string"},
    },
}
_COMMON = {
    "model": {"type": "string", "minLength": 1, "description": "a served model name or alias (GET /v1/models)"},
    "stream": {"type": "boolean", "default": False},
    "max_tokens": {"type": "integer", "minimum": 0, "description": "capped by proxy.limits.max_tokens if set"},
    "temperature": {"type": "number"},
    "user": {"type": "string", "description": "also the session key for session affinity"},
}
_CHAT_REQUEST = {
    "type": "object", "required": ["model", "messages"],
    "properties": {**_COMMON, "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
                   "max_completion_tokens": {"type": "integer", "minimum": 0}},
}
_COMPLETION_REQUEST = {
    "type": "object", "required": ["model", "prompt"],
    "properties": {**_COMMON, "prompt": {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}, "minItems": 1}]}},
}
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_WORKER_ID = {"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}}
_OBJECT = _json({"type": "object"})


def _op(summary: str, responses: dict[str, Any], *, body: dict[str, Any] | None = None, tag: str,
        security: list[dict[str, list[str]]] | None = None, parameters: list[dict[str, Any]] | None = None,
        ) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "tags": [tag], "responses": {**responses, **_ERRORS}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if security is not None:
        op["security"] = security
    if parameters:
        op["parameters"] = parameters
    return op


def build_document() -> dict[str, Any]:
    """The whole document; pure, so tests and the route share it."""
    _, defs = models_json_schema([(WorkerRegistration, "validation"), (LoadReport, "validation"),
                                  (RegistrationAccepted, "serialization")], ref_template=_REF)
    schemas = {**defs.get("$defs", {}), "Error": _ERROR_SCHEMA, "ContentPart": _CONTENT_PART,
               "ChatMessage": _MESSAGE, "ChatCompletionRequest": _CHAT_REQUEST,
               "CompletionRequest": _COMPLETION_REQUEST}
    stream_or_json = {"description": "the worker's answer, relayed: JSON, or text/event-stream when stream is true",
                      "content": {"application/json": {"schema": {"type": "object"}},
                                  "text/event-stream": {"schema": {"type": "string"}}}}
    openai = "OpenAI-compatible"
    ops, control = "operations", "control plane"
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _op("Chat completion on the best worker for the request", {
            "200": stream_or_json}, body=_ref("ChatCompletionRequest"), tag=openai, security=_BEARER)},
        "/v1/completions": {"post": _op("Text completion on the best worker for the request", {
            "200": stream_or_json}, body=_ref("CompletionRequest"), tag=openai, security=_BEARER)},
        "/v1/models": {"get": _op("Each served model once, with aliases", {"200": _OBJECT}, tag=openai,
                                  security=_BEARER)},
        "/health": {"get": _op("Liveness of the proxy", {"200": _OBJECT}, tag=ops, security=[{}])},
        "/ready": {"get": _op("Whether any worker can serve", {"200": _OBJECT}, tag=ops, security=[{}])},
        "/metrics": {"get": _op("Prometheus metrics", {"200": {"description": "Prometheus text format",
                                                               "content": {"text/plain": {"schema": {"type": "string"}}}}},
                                tag=ops, security=_BEARER)},
        "/openapi.json": {"get": _op("This document", {"200": _OBJECT}, tag=ops, security=[{}])},
        "/workers": {
            "get": _op("Every registered worker with its state and last load report", {"200": _OBJECT},
                       tag=control, security=_BEARER),
            "post": _op("Register a worker (worker token); answers its per-worker secret",
                        {"200": _json(_ref("RegistrationAccepted"))}, body=_ref("WorkerRegistration"),
                        tag=control, security=_BEARER),
        },
        "/workers/{worker_id}": {
            "get": _op("One worker", {"200": _OBJECT}, tag=control, security=_BEARER, parameters=[_WORKER_ID]),
            "delete": _op("Deregister a worker (admin token or the worker's secret)", {"200": _OBJECT},
                          tag=control, security=_BEARER, parameters=[_WORKER_ID]),
        },
        "/workers/{worker_id}/report": {"post": _op(
            "A worker's load report (its secret), at 4 Hz or more", {"200": _OBJECT}, body=_ref("LoadReport"),
            tag=control, security=_BEARER, parameters=[_WORKER_ID])},
        "/workers/{worker_id}/drain": {"post": _op(
            "Stop sending new work to a worker", {"200": _OBJECT}, tag=control, security=_BEARER,
            parameters=[_WORKER_ID])},
        "/nodes/add": {"post": _op("LMDeploy proxy compatibility: register a worker by URL", {"200": _OBJECT},
                                   body={"type": "object", "required": ["url"], "properties": {
                                       "url": {"type": "string"}, "status": {"type": ["object", "null"]}}},
                                   tag=control, security=_BEARER)},
        "/nodes/remove": {"post": _op("LMDeploy proxy compatibility: deregister by URL", {"200": _OBJECT},
                                      body={"type": "object", "required": ["url"],
                                            "properties": {"url": {"type": "string"}}},
                                      tag=control, security=_BEARER)},
        "/nodes/status": {"get": _op("LMDeploy proxy compatibility: workers by URL", {"200": _OBJECT},
                                     tag=control, security=_BEARER)},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvroute proxy", "version": "1",
                 "description": "OpenAI-compatible request distribution for Qwen3-VL fleets. Client API keys, "
                                "the admin token and the worker token are bearer tokens; each is required only "
                                "when configured (see the README's Security model)."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def add_routes(app: web.Application) -> None:
    body = orjson.dumps(build_document())

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app.router.add_get("/openapi.json", openapi_json)
