"""How one upstream attempt ended, as the exchange reports it to the journey: retryable, or relayed.

Owns the two outcome types and the modes an exchange handles a response in; what to do about an
outcome is classify.py's and record.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

# How the response is handled: a worker's stream, a worker's whole answer, the internal app's answer.
STREAM, WHOLE, PASS = 0, 1, 2


@dataclass(slots=True)
class Retryable:
    """Nothing reached the client yet, so another worker may serve the request."""

    reason: str                 # connect_error | first_byte_timeout | status_5xx | status_429 | broken_body | ...
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
