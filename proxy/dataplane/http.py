"""HTTP/1.1 message pieces the data plane writes: status lines, header filtering, error responses.

Owns which headers cross the proxy in each direction (hop-by-hop ones never do), what a header field may
hold (checked on every value the proxy writes, whatever its source), and the bytes of responses the proxy
answers itself; parsing is httptools', connections are server.py's.
"""

from __future__ import annotations

import re
from http import HTTPStatus

import orjson

from proxy.errors import ProxyError, error_body
from proxy.security import peer
from proxy.security.clientauth import CLIENT_CREDENTIAL_HEADERS

Headers = list[tuple[bytes, bytes]]

# RFC 9110 7.6.1, plus what a proxy must not pass on: framing is redone on each side.
HOP_BY_HOP = frozenset((
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"expect",
))
# Set by the data plane for the control-plane app (proxy/security/peer.py); a client's copies are dropped.
INTERNAL_HOP = frozenset(h.encode() for h in peer.INTERNAL_HEADERS)
# Client credentials: meant for this proxy, never for a worker (a worker gets its own key, if any).
CLIENT_CREDENTIALS = frozenset(h.encode() for h in CLIENT_CREDENTIAL_HEADERS)
# Replaced on the way to a worker (request id, via chain) or on the way back (worker, request id).
TO_WORKER_REPLACED = frozenset((b"host", b"accept-encoding", b"x-request-id", b"x-kvroute-via")) | INTERNAL_HOP
FROM_WORKER_REPLACED = frozenset((b"x-request-id", b"x-kvroute-worker"))

# A header value the proxy writes or relays holds at most this many bytes, and none of the control bytes
# RFC 9110 5.5 excludes (HTAB is allowed): a CR or LF there would end the header, or the head, early.
MAX_VALUE_BYTES = 8192
_not_in_value = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]").search
_token = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+").fullmatch  # RFC 9110 5.1: a field name
_ESCAPE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f%]")

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    return line


def valid_value(value: bytes) -> bool:
    return len(value) <= MAX_VALUE_BYTES and _not_in_value(value) is None


def invalid_field(headers: Headers) -> bytes | None:
    """The first header of `headers` that may not be relayed (a name that is not a token, a value too long or
    holding a control byte), or None. Once per worker answer: kept to plain loops and bound methods."""
    for name, value in headers:
        if len(value) > MAX_VALUE_BYTES or _not_in_value(value) is not None or _token(name) is None:
            return name
    return None


def safe_value(value: str | bytes) -> bytes:
    """`value` as a header value the proxy may write: as it is when valid; else its control bytes (and `%`)
    percent-escaped and the result cut to MAX_VALUE_BYTES, so it can neither split a head nor grow one."""
    raw = value.encode("utf-8", "backslashreplace") if isinstance(value, str) else value
    if valid_value(raw):
        return raw
    return _ESCAPE.sub(lambda m: b"%%%02X" % m.group()[0], raw)[:MAX_VALUE_BYTES]


def connection_named(headers: Headers) -> frozenset[bytes]:
    """Header names a Connection header lists: hop-by-hop for this one connection (RFC 9110 7.6.1)."""
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    return frozenset(named)


def filtered(headers: Headers, drop: frozenset[bytes], also: frozenset[bytes] = frozenset()) -> bytes:
    """The header lines of `headers` whose (lower-case) names are in neither set, serialised."""
    out = []
    for name, value in headers:
        low = name.lower()
        if low not in drop and low not in also:
            out.append(name + b": " + value + b"\r\n")
    return b"".join(out)


def header_value(headers: Headers, lower_name: bytes) -> bytes | None:
    for name, value in headers:
        if name.lower() == lower_name:
            return value
    return None


def error_response(exc: ProxyError, extra: dict[str, str], keep_alive: bool) -> bytes:
    """A whole response in OpenAI's error body for `exc`, with its headers and `extra`."""
    body = orjson.dumps(error_body(exc.message, exc.err_type, exc.code, exc.param))
    lines = [k.encode("latin-1") + b": " + safe_value(v) + b"\r\n" for k, v in {**exc.headers, **extra}.items()]
    return b"".join((status_line(exc.status), b"Content-Type: application/json\r\n", *lines,
                     b"Content-Length: %d\r\n" % len(body),
                     b"" if keep_alive else b"Connection: close\r\n", b"\r\n", body))


def plain_response(status: int, body: bytes, content_type: bytes, extra: Headers, keep_alive: bool) -> bytes:
    return b"".join((status_line(status), b"Content-Type: " + content_type + b"\r\n",
                     *(n + b": " + safe_value(v) + b"\r\n" for n, v in extra), b"Content-Length: %d\r\n" % len(body),
                     b"" if keep_alive else b"Connection: close\r\n", b"\r\n", body))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
