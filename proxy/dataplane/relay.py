"""The client's side of one exchange: the response head it gets, how its body is framed, what is written
when, and how a stream its worker broke ends.

Owns framing (a length, chunks, or the connection's end), the head's header lines (hop-by-hop and replaced
ones dropped, the proxy's own added), writing bytes as they arrive (whole events only for a tracked stream),
and end_stream. Not reading the worker (exchange.py) nor deadlines. `Client` is what this and the modules
above need of a client connection (connection.py's ClientConnection), so none of them imports it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import orjson

from proxy.dataplane import http
from proxy.dataplane.migration import StreamTracker
from proxy.dataplane.outcome import PASS, Relayed
from proxy.errors import error_body

log = logging.getLogger("kvroute.dataplane")

# How the client's body is framed once the head is sent.
NO_BODY, LENGTH, CHUNKED, CLOSE = range(4)

_NONE: frozenset[bytes] = frozenset()


class ClientListener(Protocol):
    """What the client connection tells the exchange relaying into it (exchange.py's Exchange)."""

    def client_paused(self) -> None: ...

    def client_resumed(self) -> None: ...

    def client_lost(self) -> None: ...


class Client(Protocol):
    """What the data plane needs of a client connection (connection.py's ClientConnection)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    http11: bool
    keep_alive: bool
    closed: bool
    write_blocked_since: float | None
    exchange: ClientListener | None
    peer: bytes

    def write(self, data: bytes) -> None: ...

    def abort(self) -> None: ...

    def response_done(self) -> None: ...


class Relay:
    """Writes one exchange's response to the client: `commit` the head, `flush` body bytes as they come."""

    __slots__ = ("client", "mode", "extra", "head_request", "tracker", "resumed", "framing", "held_head", "sse",
                 "ends_clean", "tail", "tail_before")

    def __init__(self, client: Client, mode: int, extra: bytes, head_request: bool, tracker: StreamTracker | None,
                 resumed: bool) -> None:
        self.client = client
        self.mode = mode
        self.extra = extra                # the proxy's own header lines (x-kvroute-worker, x-request-id, ...)
        self.head_request = head_request
        self.tracker = tracker            # a migratable stream: its events are read (and rewritten when resumed)
        self.resumed = resumed            # the client already has the head and the first events
        self.framing = NO_BODY
        self.held_head = b""              # written with the first piece of body (one send instead of two)
        self.sse = False
        self.ends_clean = True            # the last bytes written end an SSE event
        self.tail = self.tail_before = b""  # the last two pieces of body written (usage.py reads the answer's usage)

    def head(self, status: int, headers: http.Headers, index: dict[bytes, bytes], framing: int,
             length: int = 0) -> bytes:
        """The response head for the client: the worker's header lines less hop-by-hop ones, ours, framing."""
        drop = http.connection_named(headers) if b"connection" in index else _NONE
        if self.mode != PASS:
            drop = drop | http.FROM_WORKER_REPLACED if drop else http.FROM_WORKER_REPLACED
        lines = http.filtered(headers, http.HOP_BY_HOP, drop)
        if framing == LENGTH:
            end = b"Content-Length: %d\r\n" % length
        elif framing == CHUNKED:
            end = b"Transfer-Encoding: chunked\r\n"
        else:
            end = b""
        if self.head_request:
            value = index.get(b"content-length")
            end = b"Content-Length: " + value + b"\r\n" if value is not None else b""
        if not self.client.keep_alive:
            end += b"Connection: close\r\n"
        return b"".join((http.status_line(status), lines, self.extra, end, b"\r\n"))

    def commit(self, status: int, headers: http.Headers, index: dict[bytes, bytes], close_delimited: bool,
               sse: bool) -> None:
        """The response goes to the client as it arrives: choose its framing and hold its head."""
        self.sse = sse
        if self.resumed:  # the client has its head: the continuation's events join its body
            self.framing = self.tracker.framing  # type: ignore[union-attr]
            return
        client = self.client
        length_value = index.get(b"content-length")
        if self.head_request or status in (204, 304):
            framing = NO_BODY
        elif self.mode == PASS and length_value is not None and not close_delimited:
            framing = LENGTH
        elif client.http11:
            framing = CHUNKED
        else:
            framing = CLOSE
            client.keep_alive = False
        self.framing = framing
        if self.tracker is not None:
            self.tracker.framing = framing
        self.held_head = self.head(status, headers, index, framing, int(length_value) if framing == LENGTH else 0)

    def whole(self, status: int, headers: http.Headers, index: dict[bytes, bytes], body: bytes) -> None:
        """The whole answer at once, with its length."""
        self.tail = body
        if not self.client.closed:
            self.client.transport.write(self.head(status, headers, index, LENGTH, len(body)) + body)

    def flush(self, out: list[bytes], last: bool = False) -> bool:
        """Write what arrived (and a held head, and with `last` the end of the body) in one send. False when
        `last` but a tracked stream is not whole (broken, or no [DONE]): its body is then left open."""
        parts = []
        tracker = self.tracker
        if self.held_head:
            parts.append(self.held_head)
            self.held_head = b""
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            if tracker is not None:
                data = tracker.feed(data)  # whole events only: a break leaves the client between two
            elif self.sse:
                self.ends_clean = data.endswith(b"\n\n")
            if data:
                self.tail_before, self.tail = self.tail, data
                if self.framing == CHUNKED:  # http.chunk(data), framed in the one join below
                    parts += (b"%x\r\n" % len(data), data, b"\r\n")
                else:
                    parts.append(data)
        if last and tracker is not None and (tracker.broken is not None or not tracker.done):
            last = False
        elif last and self.framing == CHUNKED:
            parts.append(http.LAST_CHUNK)
        if parts and not self.client.closed:
            self.client.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))
        return last

    def broke(self, reason: str, detail: str, status: int, first_byte_at: float | None) -> Relayed:
        """The worker failed after the first byte: a migratable stream is handed back open, others end."""
        client = self.client
        if self.tracker is not None and not client.closed and self.framing in (CHUNKED, CLOSE):
            log.info("worker stream broke after the first byte (%s: %s)", reason, detail)
            return Relayed(status, first_byte_at, worker_failed=True, resumable=True, break_reason=reason)
        log.warning("worker stream broke after the first byte (%s); ending the client's stream", reason)
        end_stream(client, self.framing, reason, sse=self.sse, clean=self.ends_clean)
        return Relayed(status, first_byte_at, worker_failed=True, client_gone=client.closed, break_reason=reason)


def end_stream(client: Client, framing: int, reason: str | None, sse: bool = True, clean: bool = True,
               tail: bytes = b"") -> None:
    """End the client's body after its worker failed: an SSE stream gets an error event (or, with `reason`
    None, `tail` alone: its answer was complete) and [DONE]; any other body can only be cut off."""
    if client.closed:
        return
    if sse and framing in (CHUNKED, CLOSE):
        if reason is None:
            data = tail
        else:
            event = orjson.dumps(error_body(f"The worker serving this request failed mid-stream ({reason}).",
                                            "server_error", code="worker_failed"))
            data = (b"" if clean else b"\n\n") + b"data: " + event + b"\n\ndata: [DONE]\n\n"
        if framing == CHUNKED:
            client.transport.write(http.chunk(data) + http.LAST_CHUNK)
            return
        client.transport.write(data)
    client.keep_alive = False
    client.closed = True
    if framing == CLOSE and sse:
        client.transport.close()
    else:
        client.transport.abort()
