"""Load reports answered on the public server itself, without the hop to the control-plane app.

Owns only the common case of `POST /workers/{id}/report`: the worker's own secret as a bearer token and a
valid body for a worker the registry knows. That case is what every worker sends 4-20 times a second, and
the hop (a second HTTP exchange over the internal socket, aiohttp's request machinery and its middlewares)
cost more than the report itself. Anything else (another credential, a bad body, an unknown worker, a
worker id that does not match) returns None and goes the usual way, so every refusal and its wording
stay the control plane's (proxy/api/control.py).
"""

from __future__ import annotations

import hashlib
import hmac

import orjson
from pydantic import ValidationError

from proxy import protocol
from proxy.dataplane import http
from proxy.protocol import LoadReport
from proxy.registry import Registry

_PREFIX, _SUFFIX = b"/workers/", b"/report"


def report_worker_id(method: bytes, url: bytes) -> str | None:
    """The worker id of a `POST /workers/{id}/report` (no query string), else None."""
    if method != b"POST" or not url.startswith(_PREFIX) or not url.endswith(_SUFFIX):
        return None
    raw = url[len(_PREFIX):-len(_SUFFIX)]
    if not raw or b"/" in raw or b"%" in raw or b"?" in raw:
        return None  # escaped or odd ids: the control plane's router decodes and answers those
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return None


def _bearer(authorization: bytes | None) -> bytes | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def answer_report(registry: Registry, worker_id: str, authorization: bytes | None, body: bytes,
                  keep_alive: bool) -> bytes | None:
    """The whole response to a worker's own valid report, once recorded; None to hand the request over."""
    worker = registry.get(worker_id)
    token = _bearer(authorization)
    if worker is None or token is None or not worker.secret_hash:
        return None
    if not hmac.compare_digest(hashlib.sha256(token).hexdigest(), worker.secret_hash):
        return None
    try:
        report = LoadReport.model_validate_json(body)
    except ValidationError:
        return None
    if report.worker_id != worker_id or not registry.record_report(worker_id, report):
        return None  # record_report changes nothing when it answers False: the control plane says why
    answer = orjson.dumps({"ok": True, "report_interval_s": protocol.report_interval_for(len(registry))})
    return http.plain_response(200, answer, b"application/json", [], keep_alive)
