"""A failed attempt in proxy/dataplane/retry_policy.py's terms, and what one request may still spend on retries.

Owns the mapping from an exchange's Retryable to retry_policy's Attempt and the request's budget: `retries`
attempts that ran something, plus up to FREE_MOVES moves past workers that ran nothing (unreachable or
stalled), and the workers whose error answer waits on the request's outcome to count against them. The
verdict itself is retry_policy.classify's, which stays pure; what counts against a worker is record.py's.
"""

from __future__ import annotations

from proxy.dataplane.outcome import Retryable
from proxy.dataplane.retry_policy import Action, Attempt, Failure, Verdict, classify
from proxy.workers.registry import Worker

# Failures that ran nothing for the client (unreachable or stalled worker): moving on costs no retry.
FREE_REASONS = frozenset({"connect_error", "stalled"})
FREE_MOVES = 8
# Failures of a non-streamed request while its worker was generating: it starts again on another worker.
RESTARTED = frozenset({"broken_body", "stalled", "connection_lost", "broken_before_first_chunk"})
# Deadlines that passed: slowness, unless the engine stood still meanwhile (record.py asks its progress).
TIMEOUTS = frozenset({"first_byte_timeout", "idle_timeout", "total_timeout"})
# An engine's own failure answers (not 503, a worker draining or full; not 504, slowness): a request that makes
# every engine fail fails the next worker too, so one counts against its worker only once another served it.
ENGINE_ERRORS = frozenset({500, 502})


def attempt_of(failure: Retryable) -> Attempt:
    """A failed exchange in retry_policy's terms."""
    if failure.status is not None:
        return Attempt(status=failure.status, body=failure.body, accepted=True, retry_after=failure.retry_after)
    if failure.reason == "connect_error":
        return Attempt(failure=Failure.CONNECT)
    if failure.reason in ("first_byte_timeout", "idle_timeout", "total_timeout"):
        return Attempt(failure=Failure.TIMEOUT, accepted=True)
    return Attempt(failure=Failure.BROKEN, accepted=True)


class RetryBudget:
    """The attempts one request has made, and the statuses its workers answered."""

    __slots__ = ("retries", "attempt", "free", "statuses", "suspects")

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self.attempt = 0        # attempts that counted against `retries`
        self.free = 0           # moves past a worker that ran nothing
        self.statuses: list[int] = []
        # (worker, detail) of each ENGINE_ERRORS answer retried elsewhere: blamed once another worker serves it
        self.suspects: list[tuple[Worker, str]] = []

    def verdict(self, failure: Retryable) -> Verdict:
        """What to do after `failure`; a retry it allows is spent."""
        # A worker that could not be reached or was stalled ran nothing for the client: moving on from it
        # costs no retry (bounded: the tried set grows, and at most FREE_MOVES of them).
        moved = self.retries > 0 and failure.reason in FREE_REASONS and self.free < FREE_MOVES
        verdict = classify(attempt_of(failure), 1 if moved else self.attempt + 1, self.retries + 1, self.statuses)
        if failure.status is not None:
            self.statuses.append(failure.status)
        if verdict.action is Action.RETRY:
            if moved:
                self.free += 1
            else:
                self.attempt += 1
        return verdict
