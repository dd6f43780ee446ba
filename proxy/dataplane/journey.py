"""One completion request's journey, in named stages: intake, pick, attempt, classify, resume, record.

Owns the order of the stages and nothing else: intake.py admits the request and prepares its trip,
attempt.py picks a worker and runs one attempt (stages.py: a disaggregated model's encode, prefill and decode
legs), classify.py says whether a failure is retried, resume.py continues a stream its worker broke after the
first byte (migration), record.py records how it ended and writes the proxy's own answers. The decisions are proxy/routing/service.py's; bytes are exchange.py's.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.dataplane.attempt import AttemptRunner
from proxy.dataplane.identity import request_id
from proxy.dataplane.incoming import IncomingRequest
from proxy.dataplane.intake import Intake
from proxy.dataplane.outcome import Retryable
from proxy.dataplane.pool import UpstreamPool
from proxy.dataplane.record import Recorder
from proxy.dataplane.relay import Client
from proxy.dataplane.resume import Resumer
from proxy.dataplane.retry_policy import Action
from proxy.dataplane.stages import Stages
from proxy.dataplane.stall import EngineProbe, StallWatch
from proxy.dataplane.trip import Trip
from proxy.errors import ProxyError
from proxy.observability.metrics import ProxyMetrics
from proxy.observability.request_watch import Observer
from proxy.routing.live import LiveConfig
from proxy.routing.service import RoutingService
from proxy.security.clientauth import ClientAuth
from proxy.workers.registry import Registry

log = logging.getLogger("kvroute.dispatch")


class Journey:
    """Serves /v1/chat/completions and /v1/completions for the data plane."""

    def __init__(self, live: LiveConfig, routing: RoutingService, client_auth: ClientAuth, registry: Registry,
                 metrics: ProxyMetrics, pool: UpstreamPool, instance_id: str, observer: Observer | None = None, *,
                 probe: EngineProbe) -> None:
        # traces, access log, explained decisions (proxy/observability/request_watch.py)
        self.observer = observer or Observer.from_config(live.proxy)
        self.intake = Intake(live, routing, client_auth, metrics, instance_id)
        stalls = StallWatch(registry, lambda: live.proxy.timeouts,
                            lambda worker_id: live.policies.deps.estimator.for_worker(worker_id), probe)
        self.attempts = AttemptRunner(live, routing, pool, stalls, metrics)
        self.record = Recorder(registry, metrics, lambda: live.proxy.timeouts)
        self.resumer = Resumer(live, self.attempts, self.record)
        self.stages = Stages(live, self.attempts, registry)

    async def serve(self, client: Client, req: IncomingRequest) -> None:
        """Answer `req` on `client`, whatever happens; the client's next request waits until then."""
        rid = request_id(req.header(b"x-request-id"))
        trip = Trip(req, rid, self.observer.watch(req, client.peer, rid))
        admitted = False
        try:
            await self.intake.admit(trip)
            admitted = True
            await self.route(client, trip)
        except ProxyError as exc:
            self.record.refused(client, trip, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error serving %s", req.url.decode("latin-1"))
            if admitted:  # part of an answer may be out: the connection cannot carry another
                client.abort()
                return
            self.record.crashed(client, trip)
        finally:
            trip.watch.finish()
        client.response_done()

    async def route(self, client: Client, trip: Trip) -> None:
        """Pick -> attempt (a disaggregated model's: its stages) -> classify until an attempt answers the client
        or none may; resume a stream its worker broke; record how it ended."""
        attempts = self.attempts
        try:
            while True:
                decision = await attempts.pick(trip)
                if decision is None:  # every worker that could take it was tried
                    self.record.exhausted(client, trip)
                    return
                staged = decision.plan
                if staged is None or (staged.whole and trip.handoff is None):
                    worker = decision.worker
                    attempts.chosen(trip, decision)
                    outcome = await attempts.run(client, trip, decision, trip.body)
                else:  # encode, prefill, decode (what an earlier try did is not done again)
                    worker, outcome = await self.stages.run(client, trip, decision)
                if isinstance(outcome, Retryable):  # nothing reached the client yet
                    verdict = trip.budget.verdict(outcome)
                    self.record.failed_attempt(trip, worker, outcome, verdict)
                    if verdict.action is not Action.RETRY:
                        self.record.answer_failure(client, trip, verdict, outcome, worker)
                        return
                    if verdict.delay_s:
                        await asyncio.sleep(verdict.delay_s)
                    continue
                if outcome.resumable and trip.tracker is not None:
                    first_byte_at = outcome.first_byte_at  # the client's first byte, for its TTFT
                    try:
                        worker, outcome = await self.resumer.resume(client, trip, worker, outcome)
                    finally:
                        trip.watch.migrations = trip.tracker.migrations  # the access log's count
                    trip.watch.worker = worker.worker_id  # the access log's: the worker that ended the stream
                    outcome.first_byte_at = first_byte_at
                if trip.tracker is not None and trip.tracker.text_limited:  # it could not have moved: counted
                    self.record.migration(trip, "text_limit")
                self.record.served(trip, worker, outcome)
                return
        finally:
            if trip.handoff is not None:  # a prefill worker may hold KV that no decode worker will pull
                self.stages.release_later(trip)
