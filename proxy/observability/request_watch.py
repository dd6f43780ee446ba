"""What the data plane reports about each /v1 request: its trace, its access-log line, its explained decision.

Owns the per-request record (RequestWatch) that proxy/dataplane/journey.py fills in at fixed points (parsed,
picking, decided, upstream, attempt ended, answered, finished) and the Observer that makes one per request
from the proxy config. Nothing here decides or forwards anything; with tracing off no trace object exists.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol, TypeVar

from proxy.observability.accesslog import AccessLog
from proxy.observability.decision import ADMIN_TOKEN_HEADER, DEBUG_HEADER, DebugGate, explain, wants_debug
from proxy.observability.tracing import TRACEPARENT, RequestTrace, Tracing, tracing_from_settings

log = logging.getLogger("kvroute.observability")

T = TypeVar("T")
_NONE: frozenset[bytes] = frozenset()
_TRACE_HEADERS = frozenset((TRACEPARENT,))


class _Request(Protocol):
    started: float
    principal: Any

    def header(self, lower_name: bytes) -> bytes | None: ...


class RequestWatch:
    """One request's observations; every method is cheap and safe to skip."""

    __slots__ = ("observer", "rid", "started", "trace", "debug", "replaces", "model", "worker", "policy",
                 "reason", "status", "error", "first_byte_at", "attempts", "stream", "client", "pick_started",
                 "held", "migrations")

    def __init__(self, observer: Observer, rid: str, started: float, trace: RequestTrace | None,
                 debug: bool) -> None:
        self.observer = observer
        self.rid = rid
        self.started = started
        self.trace = trace
        self.debug = debug
        # headers the worker gets from the proxy instead of the client (the client's traceparent when traced)
        self.replaces = _TRACE_HEADERS if trace is not None else _NONE
        self.model: str | None = None
        self.worker: str | None = None
        self.policy: str | None = None
        self.reason: str | None = None
        self.status = 0
        self.error: str | None = None
        self.first_byte_at: float | None = None
        self.attempts = 0
        self.stream: bool | None = None
        self.client: str | None = None
        self.pick_started = 0.0
        self.held = False
        self.migrations = 0

    def parsed(self, model: str, stream: bool, principal: Any, prompt_tokens: int | None = None) -> None:
        self.model = model
        self.stream = stream
        if principal is not None and getattr(principal, "key_id", ""):
            self.client = principal.name  # a configured key's name, never the key
        if self.trace is not None:
            self.trace.event("parsed", {"kvroute.model": model, "kvroute.stream": stream,
                                        **({"kvroute.prompt_tokens": prompt_tokens} if prompt_tokens else {})})

    def picking(self, pick: Awaitable[T]) -> Awaitable[T]:
        """`await watch.picking(dispatcher.pick(...))`: the pick, timed when traced, and whether admission held
        it (the pick suspended) for a `queue` span. Untraced: `pick` itself."""
        if self.trace is None:
            return pick
        self.pick_started = time.monotonic()
        self.held = False
        return _suspends(pick, self)

    def decided(self, worker_id: str, reason: str, scores: dict[str, float] | None, policy: str,
                plan: Callable[[], str] | None = None) -> bytes:
        """A worker was picked; the `x-kvroute-decision` header line for the response when an admin asked.
        `plan`: describes a disaggregated model's plan (its stages and why), asked only when shown."""
        self.worker, self.reason, self.policy = worker_id, reason, policy
        trace = self.trace
        if trace is not None:
            now = time.monotonic()
            trace.route(self.pick_started or now, now, worker_id, reason, policy, scores, self.held,
                        plan() if plan is not None else None)
        if self.debug:
            return explain(policy, reason, worker_id, scores, self.attempts + 1, plan() if plan is not None else None)
        return b""

    def upstream(self, worker_id: str, url: str, stage: str | None = None) -> bytes:
        """An attempt starts (`stage`: which leg of a split request); the traceparent header line for the worker
        (empty when not traced)."""
        if stage is None or stage == "decode":  # a split request's earlier legs are not tries of its own
            self.attempts += 1
        trace = self.trace
        return trace.upstream_start(worker_id, url, stage) if trace is not None else b""

    def attempt_ended(self, outcome: Any, to_client: bool = True) -> None:
        """An attempt is over: `outcome` is proxy/dataplane/outcome.py's Relayed or Retryable, None when the client went away.
        `to_client` False: its answer was the proxy's to read (a split request's encode or prefill leg)."""
        if outcome is None:
            status, first_byte_at, error = None, None, "client_closed"
            if not self.status:
                self.status = 499  # as nginx logs a client that left before its answer
        else:
            status = outcome.status
            first_byte_at = getattr(outcome, "first_byte_at", None)
            if hasattr(outcome, "reason"):  # Retryable: nothing reached the client
                error = outcome.reason
            else:
                error = ("stream_error" if outcome.worker_failed else
                         "client_closed" if outcome.client_gone else None)
            if to_client:
                if first_byte_at is not None and self.first_byte_at is None:
                    self.first_byte_at = first_byte_at  # the client's first byte (a migrated stream's later ones are not)
                if status:
                    self.status = status
        self.error = error
        trace = self.trace
        if trace is not None:
            trace.upstream_end(status, first_byte_at, error)

    def answered(self, status: int, error: str | None = None) -> None:
        """The proxy answered the client itself (an error): that status is the request's."""
        self.status = status
        if error is not None:
            self.error = error

    def finish(self) -> None:
        try:
            self._finish()
        except Exception:  # what watches the request must never fail it
            log.exception("observing request %s failed", self.rid)

    def _finish(self) -> None:
        observer = self.observer
        access = observer.access_log
        if self.trace is None and (access is None or not access.enabled()):
            return  # nothing to report to
        ended = time.monotonic()
        total_ms = round((ended - self.started) * 1000, 3)
        first = self.first_byte_at
        ttft_ms = round((first - self.started) * 1000, 3) if first is not None else None
        trace = self.trace
        if trace is not None:
            attributes: dict[str, Any] = {"kvroute.request_id": self.rid, "kvroute.retries": max(0, self.attempts - 1)}
            if self.worker is not None:
                attributes["kvroute.worker"] = self.worker
            if self.error is not None:
                attributes["error.type"] = self.error
            trace.end(self.status, attributes)
        if access is not None and access.enabled():
            access.write({"ts": round(time.time(), 3), "request_id": self.rid, "model": self.model,
                          "worker": self.worker, "policy": self.policy, "reason": self.reason, "status": self.status,
                          "error": self.error, "ttft_ms": ttft_ms, "total_ms": total_ms,
                          "retries": max(0, self.attempts - 1), "migrations": self.migrations, "stream": self.stream,
                          "client": self.client})


@types.coroutine
def _suspends(pick: Awaitable[T], watch: RequestWatch) -> Generator[Any, Any, T]:
    """Await `pick` as `yield from` would, noting whether it suspended at all: admission answers at once unless
    it holds the request (a time threshold would call a slow pick on a busy machine held)."""
    steps = pick.__await__()
    try:
        pending = steps.send(None)
    except StopIteration as done:
        return done.value
    watch.held = True
    while True:
        try:
            sent = yield pending
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:  # cancellation: into the pick, as `yield from` would
            try:
                pending = steps.throw(exc)
            except StopIteration as done:
                return done.value
        else:
            try:
                pending = steps.send(sent)
            except StopIteration as done:
                return done.value


class Observer:
    """Makes a RequestWatch per request: tracing when configured, the access log unless turned off, and the
    debug header for admins."""

    def __init__(self, tracing: Tracing | None, access_log: AccessLog | None, gate: DebugGate) -> None:
        self.tracing = tracing
        self.access_log = access_log
        self.gate = gate

    @classmethod
    def from_config(cls, proxy_config: Any) -> Observer:
        tracing = tracing_from_settings(getattr(proxy_config, "otlp_endpoint", None))
        if tracing is not None:
            log.info("tracing: spans exported over OTLP (proxy.otlp_endpoint / OTEL_EXPORTER_OTLP_ENDPOINT)")
        access_log = AccessLog() if getattr(proxy_config, "access_log", True) else None
        return cls(tracing, access_log, DebugGate(proxy_config.admin_token, proxy_config.insecure_open_control_plane))

    def watch(self, req: _Request, peer: bytes, rid: str) -> RequestWatch:
        tracing = self.tracing
        trace = None
        if tracing is not None:
            trace = tracing.begin(req.header(TRACEPARENT), req.started, {"kvroute.request_id": rid})
        debug = wants_debug(req.header(DEBUG_HEADER)) and self.gate.allows(
            peer, req.header(b"authorization"), req.header(ADMIN_TOKEN_HEADER))
        return RequestWatch(self, rid, req.started, trace, debug)

    def refused(self, req: _Request, status: int, code: str | None, request_id: str | None) -> None:
        """A completion the server refused before the data plane saw it (bad credentials, too large...): its
        access-log line, with the client's request id when it sent a plain one (else None)."""
        access = self.access_log
        if access is None or not access.enabled():
            return
        access.write({"ts": round(time.time(), 3), "request_id": request_id, "model": None, "worker": None, "policy": None,
                      "reason": None, "status": status, "error": code, "ttft_ms": None,
                      "total_ms": round((time.monotonic() - req.started) * 1000, 3), "retries": 0, "migrations": 0,
                      "stream": None, "client": None})

    def close(self) -> None:
        """Write the access lines and export the spans still queued (blocking: run it off the loop)."""
        if self.access_log is not None:
            self.access_log.flush()
        if self.tracing is not None:
            self.tracing.shutdown()
