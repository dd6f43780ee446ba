"""Load reports answered on the public server itself, without the hop to the control-plane app.

Owns only the common case of `POST /workers/{id}/report`: the worker's own secret as a bearer token and a
valid body for a worker the registry knows. That case is what every worker sends 4-20 times a second, and
the hop (a second HTTP exchange over the internal socket, aiohttp's request machinery and its middlewares)
cost more than the report itself. Anything else (another credential, a bad body, an unknown worker, a
worker id that does not match) returns None and goes the usual way, so every refusal and its wording
stay the control plane's (proxy/api/control.py).
"""

from __future__ import annotations

import hmac

import orjson
from pydantic import ValidationError

from proxy import protocol
from proxy.dataplane import http
from proxy.protocol import LoadReport
from proxy.security.controlauth import presented_token, secret_hash
from proxy.workers.registry import Registry

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


def answer_report(registry: Registry, worker_id: str, authorization: bytes | None, body: bytes,
                  keep_alive: bool) -> bytes | None:
    """The whole response to a worker's own valid report, once recorded; None to hand the request over."""
    worker = registry.get(worker_id)
    # the control plane's own reading of the header (Bearer or Basic); ASCII secrets read the same either way,
    # and a header that reads differently only misses the fast path
    token = presented_token(authorization.decode("latin-1")) if authorization is not None else None
    if worker is None or token is None or not worker.secret_hash:
        return None
    if not hmac.compare_digest(secret_hash(token), worker.secret_hash):
        return None
    try:
        report = LoadReport.model_validate_json(body)
    except ValidationError:
        return None
    if report.worker_id != worker_id or not registry.record_report(worker_id, report):
        return None  # record_report changes nothing when it answers False: the control plane says why
    answer = orjson.dumps({"ok": True, "report_interval_s": protocol.report_interval_for(len(registry)),
                           **({"kv_resync": True} if worker.kv_resync else {})})
    return http.plain_response(200, answer, b"application/json", [], keep_alive)
