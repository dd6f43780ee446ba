"""How many bytes of a message head (or of a chunked body's trailers) httptools may be fed, in both directions.

Owns the running count, checked before each feed: httptools gathers a header's name and value by
concatenation in its own buffers and hands them over only when the value ends, so a check made then
comes after a huge value was already held and copied over and over. What is refused and how is the
caller's (connection.py answers 431, exchange.py treats the worker's answer as a bad response).
"""

from __future__ import annotations

from typing import Protocol

# A worker's response head (interim 1xx heads included) or trailers: engines send a few hundred bytes.
MAX_RESPONSE_HEAD_BYTES = 64 * 1024
# The request line besides its URL, and the head's own CRLFs: the room a request head has on top of
# proxy.limits.max_header_bytes and the URL's bound.
REQUEST_LINE_SLACK = 256


class Parser(Protocol):
    def feed_data(self, data: bytes) -> None: ...


class HeadBound:
    """The bytes fed while a head or trailers are read. The parser's callbacks say where they are: `start()`
    when one may begin (a message begins or completes, a chunk header came: trailers may follow), `reading =
    False` when it is over (the head is complete, body bytes arrived)."""

    __slots__ = ("limit", "seen", "reading", "heads")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0
        self.reading = True
        self.heads = 0  # how many were started: a new one within one feed is not the one that was counted

    def start(self) -> None:
        self.seen = 0
        self.reading = True
        self.heads += 1


def feed_bounded(parser: Parser, bound: HeadBound, data: bytes) -> bool:
    """Feed `data` to `parser`, never more than `bound` leaves while a head is read. False when a head did not
    end within its bound (the rest of `data` is not fed); a parser error propagates."""
    while bound.reading:
        room = bound.limit - bound.seen
        if len(data) <= room:
            bound.seen += len(data)
            parser.feed_data(data)
            return True
        heads = bound.heads
        bound.seen = bound.limit
        parser.feed_data(data[:room])
        if bound.reading and bound.heads == heads:
            return False
        data = data[room:]  # the head ended in the piece fed (another may have begun): go on
    parser.feed_data(data)
    return True
