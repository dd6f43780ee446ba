"""Which URL a worker tells the proxy to dial: --advertise-url, else an address the proxy can reach.

Owns the choice of host only (a bound address as is; for 0.0.0.0, the source address of this
machine's route to the proxy, found without sending a packet). Not binding nor registering.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

log = logging.getLogger("kvroute.worker")

UNSPECIFIED = ("0.0.0.0", "::", "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def route_source(host: str, port: int) -> str | None:
    """The local address this machine would send from to reach host:port (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _type, _proto, _name, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                source = s.getsockname()[0]
        except OSError:
            continue
        if source not in UNSPECIFIED:
            return str(source)
    return None


def advertise_host(bind_host: str, proxy_urls: Sequence[str]) -> str:
    """The host part of the worker's URL as the proxies should dial it.

    A specific bind address is what the proxy dials. Bound to every interface (0.0.0.0), the
    worker takes the address its route to the first proxy leaves from: a proxy on loopback gets
    127.0.0.1, one on another machine gets this machine's address on the network between them.
    """
    if bind_host not in UNSPECIFIED:
        if _is_loopback(bind_host) and any(not _is_loopback(urlsplit(u).hostname or "") for u in proxy_urls):
            log.warning("bound to %s but a proxy is on another machine (%s): it cannot reach this worker; "
                        "bind 0.0.0.0 or this machine's address, or set --advertise-url",
                        bind_host, ", ".join(proxy_urls))
        return bind_host
    for url in proxy_urls:
        parts = urlsplit(url)
        if not parts.hostname:
            continue
        if _is_loopback(parts.hostname):
            return "127.0.0.1"
        source = route_source(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        if source is not None:
            return f"[{source}]" if ":" in source else source
    return "127.0.0.1"  # standalone, or no route to any proxy: only this machine can dial us


def advertise_url(advertise: str | None, bind_host: str, port: int, proxy_urls: Sequence[str]) -> str:
    """--advertise-url when given, else http://HOST:PORT with HOST from `advertise_host`."""
    if advertise:
        return advertise.rstrip("/")
    return f"http://{advertise_host(bind_host, proxy_urls)}:{port}"
