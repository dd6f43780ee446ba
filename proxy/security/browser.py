"""What a web browser may not do to the control plane (/workers, /nodes, /fleet).

Owns three checks that keep a page open in a local browser away from the control plane: a request from a
page of another origin is refused (`Origin`, `Sec-Fetch-Site`); a request that carries no credential must
name this proxy in its `Host` (DNS rebinding: a page whose name re-resolves to 127.0.0.1 sends its own
name); and state-changing routes take `application/json` only, a type no browser sends cross-origin
without asking first. Not credentials (controlauth.py) and not which route needs what (control.py).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Iterable

from yarl import URL

from proxy.security.peer import ip_of

# The only content type a state-changing control route takes. text/plain, forms and multipart are what a
# browser sends to another origin without a CORS preflight; this proxy answers no preflight.
JSON_TYPE = "application/json"
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Sec-Fetch-Site values of a request the user made here (typed URL, the dashboard itself, a CLI sends none).
_SAME_SITE_FETCH = frozenset({"same-origin", "none"})


def _split_host(value: str) -> tuple[str, int | None] | None:
    """`name`, `name:port`, `[v6]`, `[v6]:port` -> (lowercase host without brackets, port); None if malformed."""
    value = value.strip()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else ""
    else:
        host, sep, port_text = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
        if not sep:
            host, port_text = value, ""
    if port_text and not port_text.isdigit():
        return None
    port = int(port_text) if port_text else None
    if port is not None and not 0 < port < 65536:
        return None
    return host.lower().rstrip("."), port


@functools.lru_cache(maxsize=256)
def _is_local_address(host: str) -> bool:
    """Whether `host` is an IP address of this machine: loopback, or one a socket can bind here."""
    addr = ip_of(host)
    if addr is None:
        return False
    if addr.is_loopback:
        return True
    if addr.is_unspecified or addr.is_multicast:
        return False
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(addr), 0))  # the kernel binds only an address one of this machine's interfaces has
    except OSError:
        return False
    return True


class OwnNames:
    """The names a request's Host may carry to reach this proxy: its bind address, this machine's names and
    addresses, and proxy.allowed_hosts."""

    def __init__(self, bind_host: str, extra: Iterable[str] = ()) -> None:
        names = {"localhost", bind_host.lower().strip("[]")}
        for fn in (socket.gethostname, socket.getfqdn):
            try:
                names.add(fn().lower())
            except OSError:
                pass
        self.names = frozenset(n.rstrip(".") for n in (*names, *(e.lower() for e in extra)) if n)
        self.any_name = "*" in self.names

    def allows(self, host_header: str | None) -> bool:
        if self.any_name or host_header is None:  # every browser sends a Host; HTTP/1.0 tools may not
            return True
        parsed = _split_host(host_header or "")
        if parsed is None:
            return False
        host = parsed[0]
        return host in self.names or host.endswith(".localhost") or _is_local_address(host)


def cross_origin(origin: str | None, fetch_site: str | None, host_header: str | None) -> str | None:
    """Why a request came from a page of another origin, or None when it did not (no Origin, or the page is
    this proxy's own: the dashboard)."""
    if fetch_site is not None and fetch_site.strip().lower() not in _SAME_SITE_FETCH:
        return f"Sec-Fetch-Site: {fetch_site.strip()[:32]}"
    if origin is None:
        return None
    own = _split_host(host_header or "")
    try:
        page = URL(origin.strip())
        page_host, page_port = (page.host or "").lower().rstrip("."), page.port
    except ValueError:
        return "a malformed Origin"
    if own is None or not page_host or page.scheme not in ("http", "https"):
        return "Origin " + origin.strip()[:80]
    host, port = own
    if page_host != host or (port is not None and page_port != port):
        return "Origin " + origin.strip()[:80]
    return None


def refused_content_type(method: str, content_type: str | None, has_body: bool) -> str | None:
    """Why a state-changing request's body type is refused, or None. A request without a body carries
    nothing to read, whatever its type says."""
    if method not in STATE_CHANGING or not has_body:
        return None
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == JSON_TYPE:
        return None
    return f"Content-Type {media or '(none)'}"
