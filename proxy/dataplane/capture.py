"""The proxy as the client of an exchange: where a split request's encode and prefill answers (and a release of
held KV) are read back instead of relayed.

Owns a bounded in-memory Client (relay.py's Protocol): the exchange writes the worker's answer into it as it would
into a connection, head and body, and the stage reads the body and a header back. Not what the answer means
(stage_body.py) nor the exchange itself (exchange.py).
"""

from __future__ import annotations

import asyncio

from proxy.dataplane.relay import ClientListener

# An encode or prefill answer carries one token (or none) and its transfer params: anything far larger is not one.
MAX_CAPTURED_BYTES = 4 * 1024 * 1024


class Capture:
    """A Client whose transport is itself: everything written is kept (up to MAX_CAPTURED_BYTES; past it the
    client counts as gone and the exchange stops writing)."""

    __slots__ = ("loop", "http11", "keep_alive", "closed", "write_blocked_since", "exchange", "peer", "data")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.http11 = False  # a large answer is framed by its end, never chunked: the bytes read back are the body
        self.keep_alive = True
        self.closed = False
        self.write_blocked_since: float | None = None
        self.exchange: ClientListener | None = None
        self.peer = b"kvroute"
        self.data = bytearray()

    @property
    def transport(self) -> Capture:  # relay.py writes to `client.transport`
        return self

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        self.data += data
        if len(self.data) > MAX_CAPTURED_BYTES:
            self.closed = True
            self.data.clear()

    def abort(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True

    def response_done(self) -> None:
        return None

    def answer(self) -> tuple[bytes, bytes]:
        """(head, body) of what the worker answered, as written."""
        head, _, body = bytes(self.data).partition(b"\r\n\r\n")
        return head, body


def header(head: bytes, lower_name: bytes) -> bytes | None:
    """A header's value in a captured head (its first line is the status line)."""
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == lower_name:
            return value.strip()
    return None
