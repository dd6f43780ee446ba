"""Which addresses a worker URL may point at: the CIDR allowlist, and never the proxy itself.

Owns parsing CIDR lists, the one canonical form of a worker URL, resolving a URL's host
(asynchronously) and the verdict on it; it sends no request to the URL. Not who may register
(controlauth.py) nor the probe that follows (monitor).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable

from yarl import URL

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

RESOLVE_TIMEOUT_S = 2.0


class WorkerUrlRefused(ValueError):
    """A worker URL the proxy will not send traffic to; the message is safe to show the caller."""


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDR strings -> networks (host bits allowed: "10.1.2.3/8" means 10.0.0.0/8); ValueError names the bad one."""
    out = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(str(value).strip(), strict=False))
        except ValueError:
            raise ValueError(f"not a CIDR network: {value!r}") from None
    return tuple(out)


# The numeric IPv4 forms inet_aton reads besides dotted quads: 127.1, 2130706433, 0x7f.1, 017700000001.
_LEGACY_IPV4 = re.compile(r"(0[xX][0-9a-fA-F]+|[0-9]+)(\.(0[xX][0-9a-fA-F]+|[0-9]+)){0,3}")


def _address(host: str) -> IPAddress | None:
    """The address an IP literal names, in any form a resolver accepts (IPv4-mapped IPv6 as IPv4); None for a name."""
    bare = host.split("%", 1)[0].strip("[]")
    try:
        addr = ipaddress.ip_address(bare)
    except ValueError:
        if not _LEGACY_IPV4.fullmatch(bare):
            return None
        try:
            return ipaddress.IPv4Address(socket.inet_aton(bare))
        except OSError:
            return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def address_of(host: str) -> IPAddress | None:
    """The address an IP literal names, in any form a resolver accepts (IPv4-mapped IPv6 as IPv4); None for a name."""
    return _address(host)


def is_worker_url(url: str) -> bool:
    """An absolute http(s) URL with a usable host and port: anything else fails every request later."""
    try:
        parsed = URL(url)
        host, port = parsed.host, parsed.port
    except ValueError:  # port out of range, broken IPv6 literal
        return False
    if parsed.user is not None or parsed.password is not None or parsed.raw_query_string or parsed.raw_fragment:
        return False  # credentials or a query would ride along on every probe and request
    return parsed.scheme in ("http", "https") and bool(host) and " " not in (host or "") and port is not None


def canonical_url(url: str) -> str:
    """One spelling per worker address, so that duplicate detection sees one endpoint once: an IP literal
    in its standard form (`127.1`, `2130706433`, `[::ffff:127.0.0.1]` -> `127.0.0.1`; `[0:0::1]` -> `[::1]`),
    a host name lower-cased without a trailing dot, the port always written, no trailing slash.
    Names are not resolved here: two names may be two virtual hosts behind one address."""
    parsed = URL(url)
    host = parsed.host or ""
    addr = _address(host)
    if addr is None:
        text = host.lower().rstrip(".")
    else:
        zone = host.split("%", 1)[1] if "%" in host and addr.version == 6 else ""
        text = f"[{addr}%25{zone}]" if zone else (f"[{addr}]" if addr.version == 6 else str(addr))
    return f"{parsed.scheme.lower()}://{text}:{parsed.port}{parsed.raw_path.rstrip('/')}"


def address_in(host: str, networks: Iterable[IPNetwork]) -> bool:
    """Whether the IP literal `host` lies in one of `networks` (a name or garbage: False)."""
    addr = _address(host)
    return addr is not None and any(addr.version == net.version and addr in net for net in networks)


async def resolve(host: str) -> list[str]:
    """Every address `host` resolves to (an IP literal: itself); raises OSError/TimeoutError when it does not."""
    if _address(host) is not None:
        return [host.strip("[]")]
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _is_local(addr: IPAddress, own_hosts: Iterable[str]) -> bool:
    if addr.is_loopback or addr.is_unspecified:
        return True
    return any(_address(h) == addr for h in own_hosts)


async def check_worker_url(url: str, networks: Iterable[IPNetwork], own_ports: Iterable[int] = (),
                           own_hosts: Iterable[str] = ()) -> None:
    """Raise WorkerUrlRefused unless every address of `url`'s host is allowed and none is the proxy itself.

    `own_ports`/`own_hosts`: where this proxy listens; a URL there would loop requests back into it.
    A name is resolved here and again when connecting, so an operator-controlled DNS is assumed.
    """
    parsed = URL(url)
    host = parsed.host or ""
    try:
        addresses = [a for a in (_address(x) for x in await resolve(host)) if a is not None]
    except (OSError, TimeoutError, UnicodeError):
        raise WorkerUrlRefused(f"the host of {url!r} does not resolve") from None
    nets = tuple(networks)
    if not addresses or not all(any(a.version == n.version and a in n for n in nets) for a in addresses):
        raise WorkerUrlRefused(f"{url!r} is outside proxy.worker_networks")
    ports = set(own_ports)
    if parsed.port in ports and any(_is_local(a, own_hosts) for a in addresses):
        raise WorkerUrlRefused(f"{url!r} is this proxy's own address")
