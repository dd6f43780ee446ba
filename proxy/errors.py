"""OpenAI-style error bodies and the exception that carries one through the proxy's layers.

Owns the error shape only ({"error": {"message", "type", "param", "code"}}); the layer that
knows what went wrong raises `ProxyError`, the HTTP layer turns it into a response.
"""

from __future__ import annotations

import orjson
from aiohttp import web


class ProxyError(Exception):
    """An error with its HTTP status and OpenAI error fields; raised below the HTTP layer."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.err_type, self.code, self.param)

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = {**self.headers, **(extra_headers or {})}
        return error_response(self.status, self.message, self.err_type, self.code, self.param, headers)


def error_body(message: str, err_type: str, code: str | None = None,
               param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, err_type: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(message, err_type, code, param)),
                        content_type="application/json", headers=headers)


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", code="invalid_request", param=param)


def model_not_found(model: str) -> ProxyError:
    return ProxyError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                      code="model_not_found", param="model")


def request_too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"The request body is larger than the proxy's limit of {limit} bytes.",
                      "invalid_request_error", code="request_too_large")


def no_healthy_worker(model: str) -> ProxyError:
    return ProxyError(503, f"No healthy worker is serving model `{model}` right now.", "service_unavailable",
                      code="no_healthy_worker", headers={"Retry-After": "1"})


def shutting_down() -> ProxyError:
    return ProxyError(503, "The proxy is shutting down; retry on another replica, or here once it is back.",
                      "service_unavailable", code="shutting_down", headers={"Retry-After": "2"})
