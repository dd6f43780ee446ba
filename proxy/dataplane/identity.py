"""Request identity and loop detection: the x-request-id a request carries, and the x-kvroute-via chain.

Owns which client ids are kept and when a request came back to this proxy; not routing.
"""

from __future__ import annotations

import os
import re
import uuid

from proxy.errors import ProxyError

# A client's x-request-id is kept only when it looks like an id: it is echoed, logged and forwarded.
_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")
# Each proxy adds its instance id here when forwarding; seeing its own id again means a worker URL
# points back at a proxy of this chain, and the request would otherwise circle until it times out.
VIA_HEADER = b"x-kvroute-via"
MAX_VIA_HOPS = 8


def new_instance_id() -> str:
    return uuid.uuid4().hex[:16]


def request_id(given: bytes | None) -> str:
    """The client's x-request-id when it is a plain id; otherwise (absent, long, odd bytes) a new one."""
    if given and _CLIENT_REQUEST_ID.fullmatch(given):
        return given.decode("ascii")
    return _uuid4_hex()


def _uuid4_hex() -> str:
    """uuid.uuid4().hex, without building a UUID object (a third of the cost, once per request)."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return raw.hex()


def refuse_loop(via: bytes | None, instance_id: str) -> None:
    """ProxyError 508 when this proxy already forwarded the request, or the chain is too long."""
    if not via:
        return
    hops = via.decode("latin-1").split(",")
    if instance_id in hops or len(hops) >= MAX_VIA_HOPS:
        raise ProxyError(508, "The request came back to the proxy that forwarded it: a worker URL points "
                              "at a kvroute proxy of this chain.", "server_error", code="loop_detected")


def via_chain(via: bytes | None, instance_id: str) -> bytes:
    own = instance_id.encode()
    return via + b"," + own if via else own
