"""How one upstream attempt ended, as the exchange reports it to the journey: retryable, or relayed.

Owns the two outcome types and the modes an exchange handles a response in; what to do about an
outcome is classify.py's and record.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from proxy.errors import error_body

# How the response is handled: a worker's stream, a worker's whole answer, the internal app's answer.
STREAM, WHOLE, PASS = 0, 1, 2


@dataclass(slots=True)
class Retryable:
    """Nothing reached the client yet, so another worker may serve the request."""

    reason: str                 # connect_error | first_byte_timeout | status_5xx | status_429 | broken_body |
                                # bad_response | ...
    detail: str
    status: int | None = None   # the worker's HTTP status, when it answered
    body: bytes | None = None
    content_type: str | None = None
    retry_after: str | None = None


@dataclass(slots=True)
class Relayed:
    """The client got an answer (or left): how it ended, for metrics and the circuit breaker."""

    status: int
    first_byte_at: float | None   # time.monotonic() of the first byte sent to the client
    worker_failed: bool = False   # the worker broke the response after the first byte
    client_gone: bool = False
    resumable: bool = False       # worker_failed, and the client's stream is still open for a continuation
    break_reason: str = ""        # worker_failed: connection_lost | idle_timeout | stalled | broken_stream


# A worker's answer HTTP does not allow (an unreadable or oversized head, an invalid header field).
BAD_RESPONSE = "bad_response"


def bad_response(detail: str) -> Retryable:
    """A worker's bad answer, never relayed: another worker may serve the request, else the client gets this 502."""
    body = orjson.dumps(error_body(f"The worker sent an answer HTTP does not allow ({detail}).", "server_error",
                                   code="bad_upstream_response"))
    return Retryable(BAD_RESPONSE, detail, 502, body, "application/json")
