"""A worker's circuit breaker: closed, open, half-open, and what opens it.

Owns the breaker's states and cooldowns; does no I/O and knows nothing of workers (proxy/workers/registry.py holds
one per worker; proxy/dataplane/record.py decides which failures count).
"""

from __future__ import annotations

from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"          # requests flow; consecutive failures are counted
    OPEN = "open"              # no new requests until the cooldown ends
    HALF_OPEN = "half_open"    # cooldown over: requests are trials; a failure reopens at once, a success closes


class CircuitBreaker:
    """Closed -> open after FAILURES_TO_OPEN consecutive failures; open -> half-open when the cooldown ends (or
    the worker shows it is alive again: half_open()); half-open -> closed on a success, open again on a failure,
    with a doubled cooldown. While open, failures of requests sent before it opened change nothing (one outage,
    one opening). Failures here are those the engine caused (proxy/dataplane/record.py: refused or reset
    connections, broken streams, 500s another worker did not repeat, deadlines passed while its engine stood
    still), never slowness or client errors.
    """

    FAILURES_TO_OPEN = 3
    BASE_COOLDOWN_S = 2.0
    MAX_COOLDOWN_S = 30.0

    __slots__ = ("_state", "failures", "open_until", "cooldown_s")

    def __init__(self) -> None:
        self._state = BreakerState.CLOSED
        self.failures = 0         # consecutive, while closed
        self.open_until = 0.0     # when open: the cooldown's end
        self.cooldown_s = self.BASE_COOLDOWN_S

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now >= self.open_until:
            self._state = BreakerState.HALF_OPEN
        return self._state

    def is_open(self, now: float) -> bool:
        return self._state is BreakerState.OPEN and now < self.open_until  # state(now) is OPEN

    def record_success(self) -> None:
        self._state = BreakerState.CLOSED
        self.failures = 0
        self.open_until = 0.0
        self.cooldown_s = self.BASE_COOLDOWN_S

    def record_failure(self, now: float) -> bool:
        """Count a failure; True when this one opened the circuit."""
        if self._state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures < self.FAILURES_TO_OPEN:
                return False
        elif self._state is BreakerState.OPEN and now < self.open_until:
            return False  # a request sent before it opened: the same outage
        # the last closed failure, or a failed trial once the cooldown is over: (re)open, for longer each time
        self._state = BreakerState.OPEN
        self.open_until = now + self.cooldown_s
        self.cooldown_s = min(self.cooldown_s * 2, self.MAX_COOLDOWN_S)
        return True

    def half_open(self) -> None:
        """End the cooldown now: the next request is a trial, and a failed one reopens the circuit."""
        if self._state is BreakerState.OPEN:
            self._state = BreakerState.HALF_OPEN
        self.open_until = 0.0

    def reset(self) -> None:
        self.record_success()
