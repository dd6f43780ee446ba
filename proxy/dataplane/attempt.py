"""One attempt of a request on one worker: the pick that names the worker, and the exchange with it.

Owns choosing (the routing service decides, the trip remembers who was tried, the decision is counted and
observed) and running one upstream attempt inside RoutingService.begin/end, watched for stalls, for first
tries, retries and continuations alike. What an attempt's outcome means is classify.py's and record.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import partial

from proxy.config import Timeouts
from proxy.dataplane import http
from proxy.dataplane.exchange import Exchange
from proxy.dataplane.outcome import BAD_RESPONSE, STREAM, WHOLE, Relayed, Retryable
from proxy.dataplane.pool import UpstreamPool
from proxy.dataplane.relay import Client
from proxy.dataplane.stall import StallWatch
from proxy.dataplane.trip import Trip
from proxy.dataplane.usage import answered_usage
from proxy.observability.metrics import ProxyMetrics
from proxy.routing.base import Decision
from proxy.routing.live import LiveConfig
from proxy.routing.service import RoutingService


@dataclass(frozen=True, slots=True)
class Leg:
    """How an attempt that is one stage of a split request differs from a whole request's (stages.py)."""

    stage: str              # encode | prefill | decode: its trace span says which
    timeouts: Timeouts      # kv_transfer_s bounds a split request's stages
    whole: bool = False     # the proxy reads the answer itself (encode, prefill): whole, no client headers
    label: bytes = b""      # the client's x-kvroute-worker (the decode leg: every worker of the request)


class AttemptRunner:
    """Picks workers for trips and runs attempts on them."""

    def __init__(self, live: LiveConfig, routing: RoutingService, pool: UpstreamPool, stalls: StallWatch,
                 metrics: ProxyMetrics) -> None:
        self.live = live
        self.routing = routing
        self.pool = pool
        self.stalls = stalls
        self.metrics = metrics

    def pick(self, trip: Trip) -> Awaitable[Decision | None]:
        """Await it: a worker for the trip's next attempt; None when no untried one is left; ProxyError when
        admission refuses (400, 429, 503)."""
        return trip.watch.picking(self.routing.pick(trip.policy, trip.routed, trip.served, trip.tried,
                                                    first_attempt=not trip.tried))

    def chosen(self, trip: Trip, decision: Decision, label: str | None = None) -> None:
        """The trip goes to `decision.worker` next: remember, count (under `label`, else the decision's
        reason) and observe it."""
        worker_id = decision.worker.worker_id
        trip.tried.add(worker_id)
        policy = trip.policy.name
        self.metrics.decisions.labels(policy, worker_id, label or decision.reason).inc()
        staged = decision.plan
        trip.explained = trip.watch.decided(worker_id, decision.reason, decision.scores, policy,
                                            staged.plan.describe if staged is not None else None)

    async def run(self, client: Client, trip: Trip, decision: Decision, body: bytes,
                  resumed: bool = False, leg: Leg | None = None) -> Retryable | Relayed:
        """One upstream attempt on `decision.worker` sending `body`; `resumed`: it continues the client's open
        stream (no head of its own); `leg`: it is one stage of a split request. Wrapped in
        RoutingService.begin/end, whatever happens."""
        worker = decision.worker
        endpoint = self.pool.endpoint(worker.url)
        tracker, timeouts, whole = trip.tracker, self.live.proxy.timeouts, False
        if leg is None:
            trace_line = trip.watch.upstream(worker.worker_id, worker.url)
            label = http.safe_value(worker.worker_id)
        else:
            trace_line = trip.watch.upstream(worker.worker_id, worker.url, leg.stage)
            label, timeouts, whole = leg.label, leg.timeouts, leg.whole
        request = trip.head.to(endpoint, worker, trace_line, body)
        if resumed:
            mode, extra = STREAM, b""
        elif whole:  # the proxy reads this answer itself
            mode, extra, tracker = WHOLE, b"", None
        else:
            mode = trip.mode
            extra = b"x-kvroute-worker: %s\r\nx-request-id: %s\r\n%s" % (label, trip.rid.encode(), trip.explained)
        routing = self.routing
        pulse = self.stalls.pulse(worker)
        exchange = Exchange(client, mode, extra, timeouts, tracker=tracker, resumed=resumed, pulse=pulse)
        routed = trip.routed
        ticket = routing.begin(decision, trip.policy, routed, whole)
        if routed.stream and ticket.dispatch.prefill_tokens:
            exchange.on_output = partial(routing.first_output, ticket)  # ends its part of the prefill backlog
        if decision.worker.load.rules.admit_after_head:
            exchange.on_head = partial(routing.upstream_head, ticket)
        outcome: Retryable | Relayed | None = None
        try:
            outcome = await exchange.send(self.pool, endpoint, request)
        except asyncio.CancelledError:  # the client went away
            self.metrics.requests.labels(trip.served, worker.worker_id, "client_closed").inc()
            raise
        finally:
            # Every path (success, worker failure, client disconnect/cancel) lands here exactly once.
            routing.end(ticket, outcome.first_byte_at if isinstance(outcome, Relayed) else None,
                        None if resumed or whole else answered_usage(routed, exchange.relay, outcome))
            trip.watch.attempt_ended(outcome, not whole)
            self.stalls.forget_idle(pulse)
        if isinstance(outcome, Retryable) and outcome.reason == BAD_RESPONSE:
            self.metrics.bad_responses.labels(worker.worker_id).inc()
        return outcome
