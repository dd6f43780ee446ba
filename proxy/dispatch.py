"""One request's journey: resolve the model, pick a worker, forward, retry, and admission control.

Owns the retry loop (connect error / 5xx / 429 before the first byte -> another worker, at
most `retries` times), exact in-flight accounting, and per-request metrics; admission (hold or
send) is proxy/routing/admission.py's. Forwarding itself is
upstream.py's; choosing among candidates is the policy's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from proxy import loadview
from proxy.config import FleetConfig
from proxy.errors import ProxyError, error_response, model_not_found
from proxy.loadview import Dispatch
from proxy.metrics import ProxyMetrics
from proxy.registry import Registry, Worker
from proxy.request import RoutedRequest, parse_request
from proxy.retry_policy import Action, Attempt, Failure, Verdict, classify
from proxy.routing.admission import AdmissionController
from proxy.routing.base import Decision, Policy, PolicyDeps, make_policy
from proxy.security.clientauth import ClientAuth
from proxy.security.limits import check_request
from proxy.tokens.store import TokenizerStore
from proxy.upstream import ForwardResult, RetryableFailure, Upstream, upstream_headers

log = logging.getLogger("kvroute.dispatch")

# A client's x-request-id is kept only when it looks like an id: it is echoed, logged and forwarded.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# Each proxy adds its instance id here when forwarding; seeing its own id again means a worker URL
# points back at a proxy of this chain, and the request would otherwise circle until it times out.
VIA_HEADER = "x-kvroute-via"
MAX_VIA_HOPS = 8
# Bodies larger than this are parsed in a worker thread: validating a 32 MB prompt of token ids is
# a second of Python that would otherwise stall every other request on the loop.
PARSE_IN_THREAD_BYTES = 1024 * 1024


class PolicySet:
    """The policy for each model: the model's own from config, else the global one."""

    def __init__(self, config: FleetConfig, global_policy: str, deps: PolicyDeps,
                 reuse: PolicySet | None = None) -> None:
        """`reuse`: a running set whose policy objects are kept where the name is unchanged (what they learnt)."""
        self.deps = deps
        kept = {p.name: p for p in ([reuse.default, *reuse._by_model.values()] if reuse else [])}
        self.default = kept.get(global_policy) or make_policy(global_policy, deps)
        self._by_model: dict[str, Policy] = {}
        for model in config.models:
            if model.policy and model.policy != global_policy:
                self._by_model[model.name] = kept.get(model.policy) or make_policy(model.policy, deps)

    def for_model(self, model: str) -> Policy:
        return self._by_model.get(model, self.default)


@dataclass(slots=True)
class InFlight:
    """One upstream attempt between Dispatcher.begin() and Dispatcher.end()."""

    decision: Decision
    policy: Policy
    routed: RoutedRequest
    dispatch: Dispatch
    sent_at: float  # time.monotonic()


class Dispatcher:
    """Serves /v1/chat/completions and /v1/completions end to end."""

    def __init__(self, config: FleetConfig, registry: Registry, upstream: Upstream, policies: PolicySet,
                 metrics: ProxyMetrics, client_auth: ClientAuth | None = None) -> None:
        self.config = config
        self.client_auth = client_auth or ClientAuth([])
        self.proxy_config = config.proxy
        self.registry = registry
        self.upstream = upstream
        self.policies = policies
        self.metrics = metrics
        self.admission = AdmissionController(registry, config.proxy, policies.deps.estimator)
        self.tokenizers = TokenizerStore(registry)  # each served model's, as its workers hand them over
        self.instance_id = uuid.uuid4().hex[:16]

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        started = time.monotonic()
        request_id = _request_id(request.headers.get("x-request-id"))
        model_label = "unknown"
        try:
            principal = self.client_auth.authenticate(request.headers.get("Authorization"))
            self._refuse_loop(request.headers.get(VIA_HEADER, ""))
            body = await self._read_body(request)
            session = request.headers.get("x-session-id")
            if len(body) > PARSE_IN_THREAD_BYTES:
                routed = await asyncio.to_thread(parse_request, body, kind, session)
            else:
                routed = parse_request(body, kind, session)
            model_label = self.metrics.model_label(routed.model)
            served = self.resolve_model(routed.model)
            model_label = served
            await self.tokenizers.count(routed, served)  # the engine's own count where it matters (proxy/tokens)
            check_request(routed, self.config, served)
            await self.client_auth.admit(principal, served, routed.expected_kv_tokens)
            return await self._route(request, routed, served, request_id, started)
        except ProxyError as exc:
            self.metrics.rejections.labels(model_label, exc.code or str(exc.status)).inc()
            self.metrics.requests.labels(model_label, "", str(exc.status)).inc()
            return exc.response({"x-request-id": request_id})

    def _refuse_loop(self, via: str) -> None:
        hops = via.split(",") if via else []
        if self.instance_id in hops or len(hops) >= MAX_VIA_HOPS:
            raise ProxyError(508, "The request came back to the proxy that forwarded it: a worker URL points "
                                  "at a kvroute proxy of this chain.", "server_error", code="loop_detected")

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.proxy_config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(limit)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limit) from None

    def resolve_model(self, name: str) -> str:
        """The model name workers serve for a requested name or alias; 404 if nobody knows it."""
        if self.registry.serves(name):
            return name
        configured = self.config.model(name)
        if configured is not None:
            return configured.name
        raise model_not_found(name)

    # --- pick -> forward -> retry -------------------------------------------------------
    async def _route(self, request: web.Request, routed: RoutedRequest, served: str, request_id: str,
                     started: float) -> web.StreamResponse:
        policy = self.policies.for_model(served)
        headers = upstream_headers(request.headers, request_id)
        via = request.headers.get(VIA_HEADER)
        headers[VIA_HEADER] = f"{via},{self.instance_id}" if via else self.instance_id
        body = routed.body_for_model(served)
        path = request.rel_url.raw_path_qs
        tried: set[str] = set()
        statuses: list[int] = []
        last_failure: RetryableFailure | None = None
        last_worker: Worker | None = None
        for attempt in range(self.proxy_config.retries + 1):
            decision = await self.pick(policy, routed, served, tried, first_attempt=attempt == 0)
            if decision is None:
                break
            worker = decision.worker
            tried.add(worker.worker_id)
            self.metrics.decisions.labels(policy.name, worker.worker_id, decision.reason).inc()
            response_headers = {"x-kvroute-worker": worker.worker_id, "x-request-id": request_id}
            try:
                outcome = await self._forward_once(worker, decision, policy, routed, path, body, headers,
                                                   request, response_headers)
            except asyncio.CancelledError:  # the client went away (handler cancellation)
                self.metrics.requests.labels(served, worker.worker_id, "client_closed").inc()
                raise
            if isinstance(outcome, RetryableFailure):
                last_failure, last_worker = outcome, worker
                verdict = classify(attempt_of(outcome), attempt + 1, self.proxy_config.retries + 1, statuses)
                if outcome.status is not None:
                    statuses.append(outcome.status)
                if verdict.counts_against_worker and self.registry.record_failure(worker, outcome.detail):
                    log.warning("circuit opened for %s after: %s", worker.worker_id, outcome.detail)
                log.info("request %s: worker %s failed before the first byte (%s): %s", request_id,
                         worker.worker_id, outcome.detail, verdict.action.value)
                if verdict.action is Action.RETRY:
                    self.metrics.retries.labels(served, verdict.reason).inc()
                    if verdict.delay_s:
                        await asyncio.sleep(verdict.delay_s)
                    continue
                return self._answer_failure(served, verdict, outcome, worker, request_id)
            self._record(served, worker, outcome, started)
            return outcome.response
        return self._exhausted(served, last_failure, last_worker, request_id)

    async def _forward_once(self, worker: Worker, decision: Decision, policy: Policy, routed: RoutedRequest,
                            path: str, body: bytes, headers: CIMultiDict[str], request: web.Request,
                            response_headers: dict[str, str]) -> ForwardResult | RetryableFailure:
        ticket = self.begin(decision, policy, routed)
        outcome: ForwardResult | RetryableFailure | None = None
        try:
            outcome = await self.upstream.forward(worker, path, body, headers, request, response_headers,
                                                  routed.stream)
            return outcome
        finally:
            # Every path (success, worker failure, client disconnect/cancel) lands here exactly once.
            first_byte_at = outcome.first_byte_at if isinstance(outcome, ForwardResult) else None
            self.end(ticket, first_byte_at)

    # --- the seam the data plane calls: decision, then begin/end around each upstream attempt ---
    def begin(self, decision: Decision, policy: Policy, routed: RoutedRequest) -> InFlight:
        """The request goes to decision.worker now: start its accounting. Pass the result to end()."""
        now = self.registry.clock()
        dispatch = decision.worker.load.start_request(decision.kv_tokens, now, decision.prefill_tokens,
                                                      streamed=routed.stream)
        policy.on_dispatch(decision, routed, now)
        ticket = InFlight(decision, policy, routed, dispatch, time.monotonic())
        self.admission.wake()  # a released waiter is placed: the next head sees this dispatch
        return ticket

    def first_output(self, ticket: InFlight) -> None:
        """The attempt's first generated output reached the proxy (its prefill is done; with
        loadview.ADMIT_AFTER_OUTPUT, the default, its engine may admit again: the head of a queue may go)."""
        ticket.decision.worker.load.first_output(ticket.dispatch)
        if loadview.ADMIT_AFTER_OUTPUT or loadview.ADMIT_AFTER_HEAD:
            self.admission.wake()

    def upstream_head(self, ticket: InFlight) -> None:
        """The engine answered the attempt's head (with the admit_after_head knob: it took the request in,
        so its engine may admit again and the head of a queue may go)."""
        ticket.decision.worker.load.upstream_head(ticket.dispatch)
        self.admission.wake()

    def end(self, ticket: InFlight, first_byte_at: float | None) -> None:
        """One upstream attempt is over, whatever the outcome; call exactly once per begin()."""
        ticket.decision.worker.load.finish_request(ticket.dispatch)
        ticket.policy.on_finish(ticket.decision, ticket.routed, ticket.sent_at, first_byte_at, time.monotonic())
        self.registry.notify_changed()
        self.admission.wake()

    def _record(self, served: str, worker: Worker, outcome: ForwardResult, started: float) -> None:
        if outcome.worker_failed:
            self.registry.record_failure(worker, "stream broke after the first byte")
            self.metrics.stream_failures.labels(served, worker.worker_id).inc()
            status = "stream_error"
        elif outcome.client_gone:
            status = "client_closed"
        else:
            self.registry.record_success(worker)
            status = str(outcome.status)
        self.metrics.requests.labels(served, worker.worker_id, status).inc()
        end = time.monotonic()
        self.metrics.latency.labels(served).observe(end - started)
        if outcome.first_byte_at is not None:
            self.metrics.ttft.labels(served).observe(outcome.first_byte_at - started)

    def _answer_failure(self, served: str, verdict: Verdict, failure: RetryableFailure, worker: Worker,
                        request_id: str) -> web.StreamResponse:
        """A failed attempt that retry_policy says goes back to the client (not retried)."""
        if verdict.action in (Action.PASS_THROUGH, Action.UNAVAILABLE):
            return self._exhausted(served, failure, worker, request_id)
        status = verdict.status or 502
        self.metrics.requests.labels(served, worker.worker_id, str(status)).inc()
        err_type = "invalid_request_error" if status < 500 else "server_error"
        return error_response(status, verdict.message or failure.detail, err_type, code=verdict.code,
                              headers={"x-request-id": request_id, "x-kvroute-worker": worker.worker_id})

    def _exhausted(self, served: str, failure: RetryableFailure | None, worker: Worker | None,
                   request_id: str) -> web.StreamResponse:
        headers = {"x-request-id": request_id}
        if failure is not None and worker is not None and failure.status is not None and failure.body is not None:
            # Every worker tried answered with an error: pass the last answer on, as the engine wrote it.
            headers["x-kvroute-worker"] = worker.worker_id
            self.metrics.requests.labels(served, worker.worker_id, str(failure.status)).inc()
            return web.Response(status=failure.status, body=failure.body, headers=headers,
                                content_type=(failure.content_type or "application/json").split(";")[0])
        self.metrics.rejections.labels(served, "no_healthy_worker").inc()
        self.metrics.requests.labels(served, "", "503").inc()
        detail = f" (last error: {failure.detail})" if failure else ""
        return error_response(503, f"No healthy worker could serve model `{served}`{detail}.",
                              "service_unavailable", code="no_healthy_worker",
                              headers={**headers, "Retry-After": "1"})

    # --- choosing, with admission control (proxy/routing/admission.py) ---------------------
    async def pick(self, policy: Policy, routed: RoutedRequest, served: str, tried: set[str],
                   first_attempt: bool) -> Decision | None:
        """A decision; None when no untried worker is left; ProxyError 400/429/503 when none can take it."""
        return await self.admission.admit(policy, routed, served, tried, first_attempt)

    def queue_lengths(self) -> dict[str, int]:
        return self.admission.queue_lengths()


def _request_id(given: str | None) -> str:
    """The client's x-request-id when it is a plain id; otherwise (absent, long, odd bytes) a new one."""
    if given and _CLIENT_REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"The request body is larger than the proxy's limit of {limit} bytes.",
                      "invalid_request_error", code="request_too_large")


def attempt_of(failure: RetryableFailure) -> Attempt:
    """upstream.py's RetryableFailure in retry_policy's terms. A first-byte timeout and a body that stopped
    mid-read happened after the worker took the request."""
    if failure.status is not None:
        return Attempt(status=failure.status, body=failure.body, accepted=True)
    if failure.reason == "connect_error":
        return Attempt(failure=Failure.CONNECT)
    if failure.reason == "first_byte_timeout" or failure.detail.startswith("TimeoutError"):
        return Attempt(failure=Failure.TIMEOUT, accepted=True)
    return Attempt(failure=Failure.BROKEN, accepted=True)
