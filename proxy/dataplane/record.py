"""The last stage of a completion's journey: what each way it ends records, and the answers the proxy writes
itself.

Owns the per-request metrics (requests, latency, TTFT, rejections, retries, migrations, stream failures), what
feeds a worker's circuit breaker, the access-log status of an answer the proxy wrote, and those answers: a
refusal, an attempt's failure that goes back to the client, and "every worker failed" (the last worker's own
answer, or 503).

The breaker hears of failures the engine caused: refused or reset connections, a broken stream, and a 500/502
once another worker served the same request (the request was not the cause). Slowness is not one: a deadline
that passed (first_byte_s, idle_s, total_s) counts only when the engine's progress counters stood still for the
whole wait (docs/design/liveness.md). A stall has its own mark in the registry (stall.py), lifted by the first
sign of life, so it does not count again here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from proxy.config import Timeouts
from proxy.dataplane import http
from proxy.dataplane.classify import ENGINE_ERRORS, RESTARTED, TIMEOUTS, attempt_of
from proxy.dataplane.outcome import WHOLE, Relayed, Retryable
from proxy.dataplane.relay import Client
from proxy.dataplane.retry_policy import Action, Verdict
from proxy.dataplane.trip import Trip
from proxy.errors import ProxyError
from proxy.observability.metrics import ProxyMetrics
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.dispatch")


class Recorder:
    """Records outcomes in metrics and the registry, and writes the proxy's own answers."""

    def __init__(self, registry: Registry, metrics: ProxyMetrics, timeouts: Callable[[], Timeouts]) -> None:
        self.registry = registry
        self.metrics = metrics
        self.timeouts = timeouts

    # --- the circuit breaker ----------------------------------------------------------------------------
    def engine_failed(self, worker: Worker, reason: str) -> bool:
        """Whether a failure for `reason` is the engine's: a timeout only when its progress counters stood still
        for the whole wait that timed out (a busy engine is slow, not failed)."""
        if reason not in TIMEOUTS:
            return True
        timeouts = self.timeouts()
        if reason == "idle_timeout":
            waited = timeouts.idle_s
        elif reason == "total_timeout" and timeouts.total_s is not None:
            waited = timeouts.total_s
        else:
            waited = timeouts.first_byte_s
        if worker.load.progressed_since(self.registry.clock() - waited):
            log.info("worker %s was slow (%s), not failed: its engine made progress meanwhile", worker.worker_id,
                     reason)
            return False
        return True

    def _blame(self, worker: Worker, reason: str, detail: str) -> None:
        if reason == "stalled":  # the registry's stall mark keeps it out until it shows life: no second penalty
            return
        if self.engine_failed(worker, reason) and self.registry.record_failure(worker, detail):
            log.warning("circuit opened for %s after: %s", worker.worker_id, detail)

    # --- a request the client got an answer to (or left) --------------------------------------------
    def served(self, trip: Trip, worker: Worker, outcome: Relayed) -> None:
        """`worker` ended the trip's answer as `outcome` says."""
        metrics = self.metrics
        served = trip.served
        if outcome.worker_failed:
            self._blame(worker, outcome.break_reason, f"stream broke after the first byte ({outcome.break_reason})")
            metrics.stream_failures.labels(served, worker.worker_id).inc()
            status = "stream_error"
        elif outcome.client_gone:
            status = "client_closed"
        else:
            self.registry.record_success(worker)
            status = str(outcome.status)
            if outcome.status < 400:
                for suspect, detail in trip.budget.suspects:  # their error was theirs: this worker served it
                    self._blame(suspect, "status", detail)
        metrics.requests.labels(served, worker.worker_id, status).inc()
        started = trip.req.started
        metrics.latency.labels(served).observe(time.monotonic() - started)
        if outcome.first_byte_at is not None:
            metrics.ttft.labels(served).observe(outcome.first_byte_at - started)

    # --- attempts that failed -------------------------------------------------------------------------
    def failed_attempt(self, trip: Trip, worker: Worker, failure: Retryable, verdict: Verdict) -> None:
        """`worker` failed the trip before the first byte; `verdict` says what happens next."""
        trip.last_failure, trip.last_worker = failure, worker
        if verdict.counts_against_worker:
            self._blame(worker, failure.reason, failure.detail)
        elif failure.status in ENGINE_ERRORS and verdict.action is Action.RETRY:
            trip.budget.suspects.append((worker, failure.detail))
        log.info("request %s: worker %s failed before the first byte (%s): %s", trip.rid, worker.worker_id,
                 failure.detail, verdict.action.value)
        if verdict.action is Action.RETRY:
            self.metrics.retries.labels(trip.served, verdict.reason).inc()
            if trip.mode == WHOLE and failure.reason in RESTARTED:  # it was generating: started again
                self.metrics.migrations.labels(trip.served, "restarted").inc()

    def stream_broke(self, trip: Trip, worker: Worker, reason: str) -> None:
        """`worker` broke the trip's stream, which then went on elsewhere (or ended whole)."""
        self._blame(worker, reason, f"stream broke after the first byte ({reason})")
        self.metrics.stream_failures.labels(trip.served, worker.worker_id).inc()

    def continuation_failed(self, trip: Trip, worker: Worker, failure: Retryable) -> None:
        """A continuation on `worker` failed before relaying anything: the stream is where it was."""
        if attempt_of(failure).failure is not None:
            self._blame(worker, failure.reason, failure.detail)
        log.info("request %s: continuation on %s failed: %s", trip.rid, worker.worker_id, failure.detail)

    def migration(self, trip: Trip, how: str) -> None:
        """A broken stream `continued` on another worker, or `failed` to."""
        self.metrics.migrations.labels(trip.served, how).inc()

    # --- answers the proxy writes itself ----------------------------------------------------------------
    def answer_failure(self, client: Client, trip: Trip, verdict: Verdict, failure: Retryable,
                       worker: Worker) -> None:
        """A failed attempt that retry_policy says goes back to the client (not retried)."""
        if verdict.action in (Action.PASS_THROUGH, Action.UNAVAILABLE):
            self.exhausted(client, trip)
            return
        status = verdict.status or 502
        trip.watch.answered(status)
        self.metrics.requests.labels(trip.served, worker.worker_id, str(status)).inc()
        err_type = "invalid_request_error" if status < 500 else "server_error"
        exc = ProxyError(status, verdict.message or failure.detail, err_type, code=verdict.code)
        client.write(http.error_response(exc, {"x-request-id": trip.rid, "x-kvroute-worker": worker.worker_id},
                                         client.keep_alive))

    def exhausted(self, client: Client, trip: Trip) -> None:
        """No worker is left to try: the last one's own answer as it wrote it, else ProxyError 503."""
        failure, worker = trip.last_failure, trip.last_worker
        if failure is not None and worker is not None and failure.status is not None and failure.body is not None:
            self.metrics.requests.labels(trip.served, worker.worker_id, str(failure.status)).inc()
            content_type = (failure.content_type or "application/json").encode("latin-1")
            client.write(http.plain_response(failure.status, failure.body, content_type,
                                             [(b"x-kvroute-worker", worker.worker_id.encode()),
                                              (b"x-request-id", trip.rid.encode())], client.keep_alive))
            return
        detail = f" (last error: {failure.detail})" if failure else ""
        raise ProxyError(503, f"No healthy worker could serve model `{trip.served}`{detail}.", "service_unavailable",
                         code="no_healthy_worker", headers={"Retry-After": "1"})

    def refused(self, client: Client, trip: Trip, exc: ProxyError) -> None:
        """The proxy answers the trip `exc` (refused, or no worker could serve it)."""
        trip.watch.answered(exc.status, exc.code)
        self.metrics.rejections.labels(trip.model_label, exc.code or str(exc.status)).inc()
        self.metrics.requests.labels(trip.model_label, "", str(exc.status)).inc()
        client.write(http.error_response(exc, {"x-request-id": trip.rid}, client.keep_alive))

    def crashed(self, client: Client, trip: Trip) -> None:
        """The proxy failed to handle the trip before any of its answer went out: a 500."""
        trip.watch.answered(500, "internal_error")
        client.write(http.error_response(
            ProxyError(500, "The proxy failed to handle this request.", "server_error", code="internal_error"),
            {"x-request-id": trip.rid}, client.keep_alive))
