"""Request identity and loop detection: the x-request-id a request carries, and the x-kvroute-via chain.

Owns which client ids are kept and when a request came back to this proxy; not routing.
"""

from __future__ import annotations

import os
import random
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
    if given and _CLIENT_REQUEST_ID.fullmatch(given):  # client_request_id(), without a call: once per request
        return given.decode("ascii")
    return _uuid4_hex()


def client_request_id(given: bytes | None) -> str | None:
    """The client's x-request-id when it is a plain id, else None."""
    if given and _CLIENT_REQUEST_ID.fullmatch(given):
        return given.decode("ascii")
    return None


def _uuid4_hex() -> str:
    """A uuid4's hex form from a generator of our own, seeded from os.urandom (again in a forked child): an id
    needs to be unique, not secret, and os.urandom would cost a system call per request."""
    return "%032x" % (_ids.getrandbits(128) & _UUID4_CLEAR | _UUID4_SET)


_ids = random.Random()  # seeded from os.urandom; nobody else seeds it
os.register_at_fork(after_in_child=_ids.seed)


# version 4 (bits 76-79 = 0100) and the RFC 4122 variant (bits 62-63 = 10) of a 128-bit big-endian uuid
_UUID4_CLEAR = ~((0xF << 76) | (0x3 << 62)) & ((1 << 128) - 1)
_UUID4_SET = (0x4 << 76) | (0x2 << 62)


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
