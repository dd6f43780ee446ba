"""Who is on the other end of a control-plane request: the caller's address, through one function.

Owns `client_host()` and the internal-hop headers the data plane sets when it hands a non-/v1 request
to the aiohttp app (then aiohttp's own peer is the data plane, loopback for everyone). Not who may
do what: that is controlauth.py's.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket

from aiohttp import web

# Set by the data plane on requests it forwards to the aiohttp app; any client-sent copy is stripped.
CLIENT_ADDR_HEADER = "x-kvroute-client-addr"
# Proves the forwarded address came from this process's data plane: a per-app random secret.
HOP_SECRET_HEADER = "x-kvroute-hop-secret"
HOP_SECRET_KEY = web.AppKey("kvroute_hop_secret", str)
INTERNAL_HEADERS = (CLIENT_ADDR_HEADER, HOP_SECRET_HEADER)


def install(app: web.Application) -> str:
    """Give `app` its internal-hop secret (once); the data plane sends it with CLIENT_ADDR_HEADER."""
    if HOP_SECRET_KEY not in app:
        app[HOP_SECRET_KEY] = secrets.token_urlsafe(32)
    return app[HOP_SECRET_KEY]


def hop_headers(app: web.Application, client_addr: str) -> list[tuple[str, str]]:
    """Headers the data plane adds when forwarding a request from `client_addr` to the aiohttp app."""
    return [(CLIENT_ADDR_HEADER, client_addr), (HOP_SECRET_HEADER, install(app))]


def _over_internal_hop(request: web.Request) -> bool:
    given = request.headers.get(HOP_SECRET_HEADER)
    expected = request.app.get(HOP_SECRET_KEY)
    if given is not None and expected:
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())
    # A unix socket reaches only what the proxy's own user can open: the data plane.
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    return sock is not None and getattr(sock, "family", None) == getattr(socket, "AF_UNIX", object())


def client_host(request: web.Request) -> str:
    """The caller's IP address as text ("" when unknown). Trusts the data plane's header only when the
    request provably came through the internal hop; a client-sent copy is otherwise ignored."""
    forwarded = request.headers.get(CLIENT_ADDR_HEADER)
    if forwarded is not None and _over_internal_hop(request):
        return forwarded.strip()
    return request.remote or ""


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address (a zone id dropped, an IPv4-mapped IPv6 address as IPv4); None if it is not one."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback; anything unparsable (a unix peer, "") is not."""
    addr = ip_of(host)
    return addr is not None and addr.is_loopback


def is_loopback_bind(host: str) -> bool:
    """Whether binding `host` keeps the proxy reachable from this machine only ("localhost" included)."""
    return host == "localhost" or is_loopback(host)
