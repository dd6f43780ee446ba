"""Migration: a stream its worker broke after the first byte goes on on another worker; the client sees one
stream.

Owns the loop of continuations (at most `migrations` per request, on workers whose engine can continue a
message) and how the client's stream ends when it cannot go on. What a continuation sends and how its
events join the stream is migration.py's; each continuation is an attempt (attempt.py).
"""

from __future__ import annotations

import logging

from proxy.dataplane import migration
from proxy.dataplane.attempt import AttemptRunner
from proxy.dataplane.outcome import Relayed
from proxy.dataplane.record import Recorder
from proxy.dataplane.relay import Client, end_stream
from proxy.dataplane.trip import Trip
from proxy.errors import ProxyError
from proxy.routing.base import Decision
from proxy.routing.live import LiveConfig
from proxy.workers.registry import Worker

log = logging.getLogger("kvroute.dispatch")


class Resumer:
    """Continues broken streams on other workers."""

    def __init__(self, live: LiveConfig, attempts: AttemptRunner, record: Recorder) -> None:
        self.live = live
        self.attempts = attempts
        self.record = record

    async def resume(self, client: Client, trip: Trip, worker: Worker, failure: Relayed) -> tuple[Worker, Relayed]:
        """`worker` broke the trip's stream after the first byte: continue the generation on other workers while
        the limit allows; the worker that ended it and how (worker_failed: with the error event)."""
        tracker = trip.tracker
        assert tracker is not None  # only a tracked stream is resumable
        reason = failure.break_reason
        blamed: set[str] = set()
        while True:
            if tracker.finished or not migration.token_budget_left(trip.routed.payload, tracker.tokens):
                # the answer was whole when the worker failed: end the stream as the worker would have
                self.record.stream_broke(trip, worker, reason)
                end_stream(client, tracker.framing, None, tail=tracker.closing())
                return worker, Relayed(200, failure.first_byte_at, client_gone=client.closed)
            refused = tracker.blocker
            if refused is None and tracker.migrations >= self.live.proxy.migrations:
                refused = "migration limit reached"
            decision: Decision | None = None
            if refused is None:
                decision, refused = await self._pick(trip)
            if decision is None:
                log.warning("request %s: stream from %s broke (%s) and cannot move: %s", trip.rid,
                            worker.worker_id, reason, refused)
                self.record.migration(trip, "failed")
                end_stream(client, tracker.framing, reason)
                return worker, Relayed(failure.status, failure.first_byte_at, worker_failed=True,
                                       client_gone=client.closed, break_reason=reason)
            if worker.worker_id not in blamed:
                blamed.add(worker.worker_id)
                self.record.stream_broke(trip, worker, reason)
            nxt = decision.worker
            self.attempts.chosen(trip, decision, "migration")  # its route span too
            log.info("request %s: stream from %s broke (%s) after %d tokens; continuing on %s", trip.rid,
                     worker.worker_id, reason, tracker.tokens, nxt.worker_id)
            body = migration.continuation_body(trip.routed.payload, trip.routed.kind, trip.served, tracker.text,
                                               tracker.tokens)
            tracker.begin_continuation()
            outcome = await self.attempts.run(client, trip, decision, body, resumed=True)
            if isinstance(outcome, Relayed):
                worker = nxt
                self.record.migration(trip, "continued")
                if not outcome.resumable:
                    return worker, outcome
                reason = outcome.break_reason  # it too broke, after relaying part of the rest
                continue
            reason = outcome.reason  # it failed before relaying anything: the stream is where it was
            self.record.continuation_failed(trip, nxt, outcome)

    async def _pick(self, trip: Trip) -> tuple[Decision | None, str | None]:
        """A worker whose engine can continue the trip's stream, or why there is none."""
        while True:
            try:
                decision = await self.attempts.pick(trip)
            except ProxyError as exc:
                return None, f"no worker took it ({exc.code})"
            if decision is None:
                return None, "no other worker"
            if migration.engine_continues(decision.worker, trip.routed.kind):
                return decision, None
            trip.tried.add(decision.worker.worker_id)  # its engine cannot continue a message
