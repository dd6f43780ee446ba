"""A client's request as its bytes are parsed: the head, the body, and a refusal when it may not go on.

Owns what is checked while a request arrives (URL length 414, header count and bytes 431, body size 413,
a protocol upgrade 501, client credentials on a completion's head before its body is read) and which paths
are completions (any method but POST on them: 405); not the connection it arrives on (connection.py) nor
what answers it (server.py, journey.py).
"""

from __future__ import annotations

import time
from typing import Any

from httptools import HttpRequestParser

from proxy.config import ProxyLimits
from proxy.dataplane import http
from proxy.errors import ProxyError, request_too_large
from proxy.request import CHAT, COMPLETIONS
from proxy.security.clientauth import ClientAuth

# The data plane serves these paths itself, exactly so spelled (with a query string at most); any other
# spelling goes to the control-plane app, which serves no completions.
COMPLETION_ROUTES = {b"/v1/chat/completions": CHAT, b"/v1/completions": COMPLETIONS}
MAX_URL_BYTES = 8192


class Refused(Exception):
    """Raised from a parser callback: the request is answered `error` and the connection closes after it.
    `direct`: the server answers it itself (the journey neither counts nor sees it)."""

    def __init__(self, error: ProxyError, direct: bool) -> None:
        self.error = error
        self.direct = direct


class IncomingRequest:
    """One client request, as parsed: head fields, body pieces, and a refusal if it cannot be served."""

    __slots__ = ("url", "headers", "method", "http11", "keep_alive", "kind", "parts", "size", "started",
                 "refusal", "refusal_direct", "principal", "header_bytes", "index", "reserved", "expect_continue")

    def __init__(self) -> None:
        self.url = b""
        self.headers: http.Headers = []
        self.method = b""
        self.http11 = True
        self.keep_alive = True
        self.kind: str | None = None  # CHAT or COMPLETIONS for a completion; None: anything else
        self.parts: list[bytes | bytearray] = []  # one item: the body so far
        self.size = 0
        self.started = time.monotonic()
        self.refusal: ProxyError | None = None
        self.refusal_direct = False  # answered by the server itself, not counted by the journey
        self.principal: Any = None  # who the client is, when its credentials were checked on the head
        self.header_bytes = 0
        self.index: dict[bytes, bytes] | None = None
        self.reserved = 0  # body bytes held against proxy.limits.max_buffered_body_bytes
        self.expect_continue = False

    def header(self, lower_name: bytes) -> bytes | None:
        index = self.index
        if index is None:  # built once, on the first question (the last value of a repeated name wins)
            index = self.index = {name.lower(): value for name, value in self.headers}
        return index.get(lower_name)

    def body(self) -> bytes:
        """The whole body (once: a body that came in pieces is handed over and its buffer let go)."""
        parts = self.parts
        if not parts:
            return b""
        body = parts[0]
        if isinstance(body, bytearray):
            body = parts[0] = bytes(body)
        return body

    # --- as the parser reads it -------------------------------------------------------------------
    def add_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_URL_BYTES:
            raise Refused(ProxyError(414, f"The request URL is longer than {MAX_URL_BYTES} bytes.",
                                     code="uri_too_long"), True)

    def add_header(self, name: bytes, value: bytes, limits: ProxyLimits) -> None:
        self.header_bytes += len(name) + len(value) + 4
        if len(self.headers) >= limits.max_headers:
            raise Refused(ProxyError(431, f"More than {limits.max_headers} header fields; at most "
                                          f"{limits.max_headers} are accepted.",
                                     code="request_header_fields_too_large"), True)
        if self.header_bytes > limits.max_header_bytes:
            raise Refused(ProxyError(431, f"The headers hold more than {limits.max_header_bytes} bytes; at most "
                                          f"{limits.max_header_bytes} are accepted.",
                                     code="request_header_fields_too_large"), True)
        self.headers.append((name, value))

    def head_complete(self, parser: HttpRequestParser, client_auth: ClientAuth, max_body: int) -> int | None:
        """The head is in: what it is, and whether it may go on. The body bytes to reserve; None: no body."""
        if parser.should_upgrade():
            # httptools hands over the bytes after such a head as another protocol's, body included: refused
            # here, the request gets one answer and nothing of it is served without its body.
            raise Refused(ProxyError(501, "This proxy does not switch protocols: send the request without "
                                          "`Connection: Upgrade`.", code="upgrade_not_supported"), True)
        self.method = parser.get_method()
        self.http11 = parser.get_http_version() == "1.1"
        self.keep_alive = self.http11 and parser.should_keep_alive()
        kind = COMPLETION_ROUTES.get(self.url.split(b"?", 1)[0])
        if kind is not None and self.method != b"POST":
            # answered once its body is read, and the connection closed
            self.refusal, self.refusal_direct, kind = wrong_method(), True, None
        self.kind = kind
        if kind is not None and client_auth.enabled:  # an unknown caller costs no body read
            try:
                self.principal = client_auth.authenticate(self.header(b"authorization"))
            except ProxyError as exc:
                raise Refused(exc, True) from None
        length = self.header(b"content-length")
        if length is not None and int(length) > max_body:
            raise Refused(request_too_large(max_body), kind is None)
        expect = self.header(b"expect")
        self.expect_continue = expect is not None and expect.lower() == b"100-continue" and self.http11
        if length is None and self.header(b"transfer-encoding") is None:
            return None
        return int(length) if length is not None else max_body

    def add_body(self, body: bytes, max_body: int) -> None:
        parts = self.parts
        if not parts:
            parts.append(body)
        elif len(parts) == 1 and not isinstance(parts[0], bytearray):
            # A body in pieces grows in one buffer: glibc serves it from mmap once large (security/limits.py
            # fixes the threshold) and gives it back whole, where thousands of 64 KiB pieces would fragment
            # the heap and keep a burst of large bodies resident.
            parts[0] = bytearray(parts[0])
            parts[0] += body
        else:
            parts[0] += body
        self.size += len(body)
        if self.size > max_body:
            raise Refused(request_too_large(max_body), self.kind is None)


def wrong_method() -> ProxyError:
    return ProxyError(405, "Method Not Allowed", code="method_not_allowed", headers={"Allow": "POST"})
