"""One completion request's journey: identity, parse, model, decision, forward, retry, record.

Owns the retry loop (connect error / 5xx / 429 / broken body before the first byte -> another
worker, at most `retries` times), the migration loop (a stream whose worker failed after the first
byte continues on another, at most `migrations` times), per-request metrics and the answer when every
worker failed. The decision is dispatch.py's (pick, begin, end); bytes and deadlines are exchange.py's,
what a continuation sends migration.py's, stalled workers stall.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import TYPE_CHECKING

from proxy import loadview
from proxy.dataplane import http, migration
from proxy.dataplane.exchange import STREAM, WHOLE, Exchange, Relayed, Retryable, end_stream
from proxy.dataplane.identity import VIA_HEADER, refuse_loop, request_id, via_chain
from proxy.dataplane.pool import UpstreamPool
from proxy.dataplane.stall import StallWatch
from proxy.dispatch import Dispatcher
from proxy.errors import ProxyError
from proxy.metrics import ProxyMetrics
from proxy.observability.watch import Observer, RequestWatch
from proxy.registry import Registry, Worker
from proxy.request import CHAT, RoutedRequest, parse_request
from proxy.retry_policy import Action, Attempt, Failure, Verdict, classify
from proxy.routing.base import Decision, Policy
from proxy.security.limits import check_request

if TYPE_CHECKING:
    from proxy.dataplane.pool import Endpoint
    from proxy.dataplane.server import ClientConnection, IncomingRequest

log = logging.getLogger("kvroute.dispatch")

# Bodies larger than this are parsed in a worker thread: validating a 32 MB prompt of token ids is
# a second of Python that would otherwise stall every other request on the loop.
PARSE_IN_THREAD_BYTES = 1024 * 1024

class Journey:
    """Serves /v1/chat/completions and /v1/completions for the data plane."""

    def __init__(self, dispatcher: Dispatcher, registry: Registry, metrics: ProxyMetrics, pool: UpstreamPool,
                 instance_id: str, observer: Observer | None = None) -> None:
        self.dispatcher = dispatcher
        self.registry = registry
        self.metrics = metrics
        self.pool = pool
        self.instance_id = instance_id
        self.stalls = StallWatch(registry, lambda: dispatcher.proxy_config.timeouts)
        # traces, access log, explained decisions (proxy/observability/watch.py)
        self.observer = observer or Observer.from_config(dispatcher.proxy_config)

    async def serve(self, client: ClientConnection, req: IncomingRequest) -> None:
        """Answer `req` on `client`, whatever happens; the client's next request waits until then."""
        rid = request_id(req.header(b"x-request-id"))
        watch = self.observer.watch(req, client.peer, rid)
        model_label = "unknown"
        answered = False
        try:
            if req.refusal is not None:
                raise req.refusal
            # Client authentication (proxy/security/clientauth.py): the server already ran it on the head,
            # before reading the body; here is its principal.
            principal = req.principal or self.dispatcher.client_auth.authenticate(req.header(b"authorization"))
            refuse_loop(req.header(VIA_HEADER), self.instance_id)
            body = req.body()
            session = req.header(b"x-session-id")
            session_key = session.decode("latin-1") if session is not None else None
            if len(body) > PARSE_IN_THREAD_BYTES:
                routed = await asyncio.to_thread(parse_request, body, req.kind, session_key)
            else:
                routed = parse_request(body, req.kind, session_key)
            model_label = self.metrics.model_label(routed.model)
            served = self.dispatcher.resolve_model(routed.model)
            model_label = served
            await self.dispatcher.tokenizers.count(routed, served)  # the engine's own count where it matters
            watch.parsed(served, routed.stream, principal, routed.prompt_tokens)
            check_request(routed, self.dispatcher.config, served)
            await self.dispatcher.client_auth.admit(principal, served, routed.expected_kv_tokens)
            answered = True
            await self._route(client, req, routed, served, rid, watch)
        except ProxyError as exc:
            watch.answered(exc.status, exc.code)
            self.metrics.rejections.labels(model_label, exc.code or str(exc.status)).inc()
            self.metrics.requests.labels(model_label, "", str(exc.status)).inc()
            client.write(http.error_response(exc, {"x-request-id": rid}, client.keep_alive))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error serving %s", req.url.decode("latin-1"))
            if answered:  # part of an answer may be out: the connection cannot carry another
                client.abort()
                return
            watch.answered(500, "internal_error")
            client.write(http.error_response(
                ProxyError(500, "The proxy failed to handle this request.", "server_error", code="internal_error"),
                {"x-request-id": rid}, client.keep_alive))
        finally:
            watch.finish()
        client.response_done()

    # --- pick -> forward -> retry -----------------------------------------------------------
    async def _route(self, client: ClientConnection, req: IncomingRequest, routed: RoutedRequest, served: str,
                     rid: str, watch: RequestWatch) -> None:
        dispatcher = self.dispatcher
        metrics = self.metrics
        retries = dispatcher.proxy_config.retries
        policy = dispatcher.policies.for_model(served)
        body = routed.body_for_model(served)
        # Everything of the upstream head but the request line, Host and the worker's own key.
        drop = _TO_WORKER_DROP | watch.replaces if watch.replaces else _TO_WORKER_DROP
        named = http.connection_named(req.headers) if req.header(b"connection") is not None else None
        common = b"".join((
            http.filtered(req.headers, http.HOP_BY_HOP, drop | named if named else drop),
            b"x-request-id: ", rid.encode(), b"\r\nx-kvroute-via: ",
            via_chain(req.header(VIA_HEADER), self.instance_id),
            b"\r\nContent-Length: %d\r\n" % len(body)))
        mode = STREAM if routed.stream else WHOLE
        tracker = self._tracker(routed)
        tried: set[str] = set()
        statuses: list[int] = []
        last_failure: Retryable | None = None
        last_worker: Worker | None = None
        attempt = free = 0
        while attempt <= retries:
            decision = await watch.picking(dispatcher.pick(policy, routed, served, tried, first_attempt=not tried))
            if decision is None:
                break
            worker = decision.worker
            tried.add(worker.worker_id)
            metrics.decisions.labels(policy.name, worker.worker_id, decision.reason).inc()
            explained = watch.decided(worker.worker_id, decision.reason, decision.scores, policy.name)
            endpoint = self.pool.endpoint(worker.url)
            api_key = getattr(worker, "api_key", None)
            head = b"".join((b"POST ", endpoint.base_path, req.url, b" HTTP/1.1\r\nHost: ", endpoint.host_header,
                             b"\r\n", common, watch.upstream(worker.worker_id, worker.url),
                             b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b"", b"\r\n"))
            extra = b"x-kvroute-worker: %s\r\nx-request-id: %s\r\n%s" % (worker.worker_id.encode(), rid.encode(),
                                                                           explained)
            outcome = await self._try_worker(client, served, watch, decision, policy, routed, endpoint, head + body,
                                          mode, extra, tracker)
            if isinstance(outcome, Retryable):
                last_failure, last_worker = outcome, worker
                # A worker that could not be reached or was stalled ran nothing for the client: moving on from it
                # costs no retry (bounded: the tried set grows, and at most _FREE_MOVES of them).
                moved = retries > 0 and outcome.reason in _FREE_REASONS and free < _FREE_MOVES
                verdict = classify(_attempt(outcome), 1 if moved else attempt + 1, retries + 1, statuses)
                if outcome.status is not None:
                    statuses.append(outcome.status)
                if verdict.counts_against_worker and self.registry.record_failure(worker, outcome.detail):
                    log.warning("circuit opened for %s after: %s", worker.worker_id, outcome.detail)
                log.info("request %s: worker %s failed before the first byte (%s): %s", rid, worker.worker_id,
                         outcome.detail, verdict.action.value)
                if verdict.action is Action.RETRY:
                    metrics.retries.labels(served, verdict.reason).inc()
                    if mode == WHOLE and outcome.reason in _RESTARTED:  # it was generating: started again
                        metrics.migrations.labels(served, "restarted").inc()
                    if verdict.delay_s:
                        await asyncio.sleep(verdict.delay_s)
                    if moved:
                        free += 1
                    else:
                        attempt += 1
                    continue
                self._answer_failure(client, served, verdict, outcome, worker, rid, watch)
                return
            if outcome.resumable and tracker is not None:
                first_byte_at = outcome.first_byte_at
                try:
                    worker, outcome = await self._migrate(client, req, routed, served, rid, watch, policy, tracker,
                                                          worker, outcome, tried, common)
                finally:
                    watch.migrations = tracker.migrations  # the access log's count
                watch.worker = worker.worker_id  # the access log's: the worker that ended the stream
                outcome.first_byte_at = first_byte_at  # the client's first byte, for its TTFT
            self._record(served, worker, outcome, req.started)
            return
        self._exhausted(client, served, last_failure, last_worker, rid)

    async def _try_worker(self, client: ClientConnection, served: str, watch: RequestWatch, decision: Decision,
                       policy: Policy, routed: RoutedRequest, endpoint: Endpoint, request: bytes, mode: int,
                       extra: bytes, tracker: migration.StreamTracker | None,
                       resumed: bool = False) -> Retryable | Relayed:
        """One upstream attempt on `decision.worker`, wrapped in Dispatcher.begin/end (first tries, retries and
        migrations alike)."""
        dispatcher = self.dispatcher
        pulse = self.stalls.pulse(decision.worker)
        exchange = Exchange(client, mode, extra, dispatcher.proxy_config.timeouts, tracker=tracker, resumed=resumed,
                            pulse=pulse)
        ticket = dispatcher.begin(decision, policy, routed)
        if routed.stream and ticket.dispatch.prefill_tokens:
            exchange.on_output = partial(dispatcher.first_output, ticket)  # ends its part of the prefill backlog
        if loadview.ADMIT_AFTER_HEAD:
            exchange.on_head = partial(dispatcher.upstream_head, ticket)
        outcome: Retryable | Relayed | None = None
        try:
            outcome = await exchange.send(self.pool, endpoint, request)
        except asyncio.CancelledError:  # the client went away
            self.metrics.requests.labels(served, decision.worker.worker_id, "client_closed").inc()
            raise
        finally:
            # Every path (success, worker failure, client disconnect/cancel) lands here exactly once.
            dispatcher.end(ticket, outcome.first_byte_at if isinstance(outcome, Relayed) else None)
            watch.attempt_ended(outcome)
            self.stalls.forget_idle(pulse)
        return outcome

    def _tracker(self, routed: RoutedRequest) -> migration.StreamTracker | None:
        """A stream that may migrate gets its events read; any other keeps the plain byte relay."""
        if not routed.stream or self.dispatcher.proxy_config.migrations < 1:
            return None
        if migration.refusal(routed.payload, routed.kind) is not None:
            return None
        options = routed.payload.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return migration.StreamTracker(routed.kind == CHAT, include_usage)

    async def _migrate(self, client: ClientConnection, req: IncomingRequest, routed: RoutedRequest, served: str,
                       rid: str, watch: RequestWatch, policy: Policy, tracker: migration.StreamTracker,
                       worker: Worker, failure: Relayed, tried: set[str], common: bytes) -> tuple[Worker, Relayed]:
        """`worker` broke `tracker`'s stream after the first byte: continue the generation on other workers
        while the limit allows; the worker that ended it and how (worker_failed: with the error event)."""
        dispatcher = self.dispatcher
        metrics = self.metrics
        reason = failure.break_reason
        blamed: set[str] = set()
        while True:
            if tracker.finished or not migration.token_budget_left(routed.payload, tracker.tokens):
                # the answer was whole when the worker failed: end the stream as the worker would have
                self._worker_broke(served, worker, reason)
                end_stream(client, tracker.framing, None, tail=tracker.closing())
                return worker, Relayed(200, failure.first_byte_at, client_gone=client.closed)
            refused = tracker.blocker
            if refused is None and tracker.migrations >= dispatcher.proxy_config.migrations:
                refused = "migration limit reached"
            decision = None
            while refused is None and decision is None:
                try:
                    decision = await watch.picking(dispatcher.pick(policy, routed, served, tried,
                                                                    first_attempt=False))
                except ProxyError as exc:
                    refused = f"no worker took it ({exc.code})"
                    break
                if decision is None:
                    refused = "no other worker"
                elif not migration.engine_continues(decision.worker, routed.kind):
                    tried.add(decision.worker.worker_id)  # its engine cannot continue a message
                    decision = None
            if refused is not None or decision is None:
                log.warning("request %s: stream from %s broke (%s) and cannot move: %s", rid, worker.worker_id,
                            reason, refused)
                metrics.migrations.labels(served, "failed").inc()
                end_stream(client, tracker.framing, reason)
                return worker, Relayed(failure.status, failure.first_byte_at, worker_failed=True,
                                       client_gone=client.closed, break_reason=reason)
            if worker.worker_id not in blamed:
                blamed.add(worker.worker_id)
                self._worker_broke(served, worker, reason)
            nxt = decision.worker
            tried.add(nxt.worker_id)
            metrics.decisions.labels(policy.name, nxt.worker_id, "migration").inc()
            watch.decided(nxt.worker_id, decision.reason, decision.scores, policy.name)  # its route span
            log.info("request %s: stream from %s broke (%s) after %d tokens; continuing on %s", rid,
                     worker.worker_id, reason, tracker.tokens, nxt.worker_id)
            body = migration.continuation_body(routed.payload, routed.kind, served, tracker.text, tracker.tokens)
            endpoint = self.pool.endpoint(nxt.url)
            api_key = getattr(nxt, "api_key", None)
            head = b"".join((b"POST ", endpoint.base_path, req.url, b" HTTP/1.1\r\nHost: ", endpoint.host_header,
                             b"\r\n", common.rsplit(b"Content-Length: ", 1)[0],
                             b"Content-Length: %d\r\n" % len(body), watch.upstream(nxt.worker_id, nxt.url),
                             b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b"", b"\r\n"))
            tracker.begin_continuation()
            outcome = await self._try_worker(client, served, watch, decision, policy, routed, endpoint, head + body,
                                          STREAM, b"", tracker, resumed=True)
            if isinstance(outcome, Relayed):
                worker = nxt
                metrics.migrations.labels(served, "continued").inc()
                if not outcome.resumable:
                    return worker, outcome
                reason = outcome.break_reason  # it too broke, after relaying part of the rest
                continue
            # it failed before relaying anything: the stream is where it was
            reason = outcome.reason
            if _attempt(outcome).failure is not None:
                self.registry.record_failure(nxt, outcome.detail)
            log.info("request %s: continuation on %s failed: %s", rid, nxt.worker_id, outcome.detail)

    def _worker_broke(self, served: str, worker: Worker, reason: str) -> None:
        """`worker` broke a stream that then went on elsewhere."""
        self.registry.record_failure(worker, f"stream broke after the first byte ({reason})")
        self.metrics.stream_failures.labels(served, worker.worker_id).inc()

    def _record(self, served: str, worker: Worker, outcome: Relayed, started: float) -> None:
        metrics = self.metrics
        if outcome.worker_failed:
            self.registry.record_failure(worker, "stream broke after the first byte")
            metrics.stream_failures.labels(served, worker.worker_id).inc()
            status = "stream_error"
        elif outcome.client_gone:
            status = "client_closed"
        else:
            self.registry.record_success(worker)
            status = str(outcome.status)
        metrics.requests.labels(served, worker.worker_id, status).inc()
        metrics.latency.labels(served).observe(time.monotonic() - started)
        if outcome.first_byte_at is not None:
            metrics.ttft.labels(served).observe(outcome.first_byte_at - started)

    def _answer_failure(self, client: ClientConnection, served: str, verdict: Verdict, failure: Retryable,
                        worker: Worker, rid: str, watch: RequestWatch) -> None:
        """A failed attempt that retry_policy says goes back to the client (not retried)."""
        if verdict.action in (Action.PASS_THROUGH, Action.UNAVAILABLE):
            self._exhausted(client, served, failure, worker, rid)
            return
        status = verdict.status or 502
        watch.answered(status)
        self.metrics.requests.labels(served, worker.worker_id, str(status)).inc()
        err_type = "invalid_request_error" if status < 500 else "server_error"
        exc = ProxyError(status, verdict.message or failure.detail, err_type, code=verdict.code)
        client.write(http.error_response(exc, {"x-request-id": rid, "x-kvroute-worker": worker.worker_id},
                                         client.keep_alive))

    def _exhausted(self, client: ClientConnection, served: str, failure: Retryable | None, worker: Worker | None,
                   rid: str) -> None:
        if failure is not None and worker is not None and failure.status is not None and failure.body is not None:
            # Every worker tried answered with an error: pass the last answer on, as the engine wrote it.
            self.metrics.requests.labels(served, worker.worker_id, str(failure.status)).inc()
            content_type = (failure.content_type or "application/json").encode("latin-1")
            client.write(http.plain_response(failure.status, failure.body, content_type,
                                             [(b"x-kvroute-worker", worker.worker_id.encode()),
                                              (b"x-request-id", rid.encode())], client.keep_alive))
            return
        detail = f" (last error: {failure.detail})" if failure else ""
        raise ProxyError(503, f"No healthy worker could serve model `{served}`{detail}.", "service_unavailable",
                         code="no_healthy_worker", headers={"Retry-After": "1"})


# Failures that ran nothing for the client (unreachable or stalled worker): moving on costs no retry.
_FREE_REASONS = frozenset({"connect_error", "stalled"})
_FREE_MOVES = 8
# Request headers a worker never gets from the client (besides hop-by-hop ones).
_TO_WORKER_DROP = http.CLIENT_CREDENTIALS | http.TO_WORKER_REPLACED

# Failures of a non-streamed request while its worker was generating: it starts again on another worker.
_RESTARTED = frozenset({"broken_body", "stalled", "connection_lost", "broken_before_first_chunk"})


def _attempt(failure: Retryable) -> Attempt:
    """A failed exchange in retry_policy's terms (as dispatch.attempt_of for the aiohttp path)."""
    if failure.status is not None:
        return Attempt(status=failure.status, body=failure.body, accepted=True, retry_after=failure.retry_after)
    if failure.reason == "connect_error":
        return Attempt(failure=Failure.CONNECT)
    if failure.reason in ("first_byte_timeout", "idle_timeout", "total_timeout"):
        return Attempt(failure=Failure.TIMEOUT, accepted=True)
    return Attempt(failure=Failure.BROKEN, accepted=True)
