"""A disaggregated model's request in stages: encode (its images), prefill, then decode, each on the worker the
plan names, in vLLM's protocol; the decode leg answers the client as a whole request's attempt would.

Owns the order of the legs and what each hands the next (trip.Handoff), which decode failure lets the next decode
worker pull the same KV and which needs a fresh prefill, and releasing KV a prefill worker holds for nobody. Each
leg is an attempt (attempt.py) in RoutingService.begin/end on its own worker; bodies are stage_body.py's; whether
a failed leg is retried is the journey's (retry budget, breaker), the plan proxy/routing/split.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from proxy.config import Timeouts
from proxy.dataplane import http
from proxy.dataplane.attempt import AttemptRunner, Leg
from proxy.dataplane.capture import MAX_CAPTURED_BYTES, Capture, header
from proxy.dataplane.classify import attempt_of
from proxy.dataplane.exchange import Exchange
from proxy.dataplane.outcome import WHOLE, Relayed, Retryable
from proxy.dataplane.relay import Client
from proxy.dataplane.stage_body import answer_params, decode_body, encode_body, prefill_body, release_body
from proxy.dataplane.trip import Handoff, Trip
from proxy.request import RoutedRequest
from proxy.routing.base import Decision
from proxy.routing.live import LiveConfig
from proxy.routing.media_ids import with_media_uuids
from proxy.routing.split import stage_decision
from proxy.routing.stage_plan import DECODE, ENCODE, PREFILL, StagePlan
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.dispatch")

# A release is one refused request: it needs no more than this.
RELEASE_TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=10.0, idle_s=10.0, total_s=10.0)
# Requests whose held KV is being released at once, at most (past it the prefill worker's lease frees the rest).
MAX_RELEASES = 1024


def kv_untouched(failure: Retryable, streamed: bool) -> bool:
    """Whether a decode worker's failure leaves the prefill worker's KV for another decode worker: it refused the
    request before its engine had it (429, 503), or a stream's connection broke before any byte came back (vLLM's
    server sends a stream's head before its engine is given the request). Any other failure may have come after
    its pull, which frees the blocks on the prefill worker: a fresh prefill is safe where a second pull of those
    block ids is not."""
    if failure.status in (429, 503):
        return True
    return streamed and failure.status is None and failure.reason == "connect_error"


class Stages:
    """Runs the legs of split requests (and releases what they leave behind)."""

    def __init__(self, live: LiveConfig, attempts: AttemptRunner, registry: Registry) -> None:
        self.live = live
        self.attempts = attempts
        self.registry = registry
        self._tasks: set[asyncio.Task[None]] = set()
        self._timeouts_of: Timeouts | None = None
        self._legs: tuple[Timeouts, Timeouts] = (RELEASE_TIMEOUTS, RELEASE_TIMEOUTS)

    def _leg_timeouts(self) -> tuple[Timeouts, Timeouts]:
        """(an encode or prefill leg's, a decode leg's) timeouts: the running config's, within kv_transfer_s."""
        t = self.live.proxy.timeouts
        if t is not self._timeouts_of:
            whole_s = t.kv_transfer_s if t.total_s is None else min(t.kv_transfer_s, t.total_s)
            self._legs = (t.model_copy(update={"total_s": whole_s}),
                          t.model_copy(update={"first_byte_s": min(t.first_byte_s, t.kv_transfer_s)}))
            self._timeouts_of = t
        return self._legs

    async def run(self, client: Client, trip: Trip, decision: Decision) -> tuple[Worker, Retryable | Relayed]:
        """The legs `decision.plan` names that have not run yet, then the decode leg on `decision.worker`; the
        worker the outcome is about (a failed prefill worker, else the one that generated) and the outcome."""
        staged = decision.plan
        assert staged is not None  # the journey sends only planned requests here
        handoff = trip.handoff
        if handoff is None:
            handoff = trip.handoff = Handoff()
        whole_timeouts, decode_timeouts = self._leg_timeouts()
        if staged.encode is not None and not handoff.encoded:
            await self._encode(client, trip, staged, handoff, whole_timeouts)
        if staged.prefill is not None and handoff.prefill is None:
            failed = await self._prefill(client, trip, staged, handoff, whole_timeouts)
            if failed is not None:
                return failed
        generator = decision.worker
        label = ",".join(w for w in (handoff.encoder, handoff.prefill.worker_id if handoff.prefill else None,
                                     generator.worker_id) if w)
        self.attempts.chosen(trip, decision)
        trip.watch.worker = label  # the access log names every worker of the request
        routed = trip.routed
        # the encoder's output goes to the worker that computes the prompt: after a prefill, the KV carries it
        body = decode_body(_payload(routed), trip.body, trip.served, handoff.kv_params,
                           handoff.ec_params if handoff.prefill is None else None)
        outcome = await self.attempts.run(client, trip, decision, body, leg=Leg(DECODE, decode_timeouts,
                                                                                label=http.safe_value(label)))
        if isinstance(outcome, Relayed):
            trip.handoff = None  # the decode worker has the KV (or let it go, as its engine does when aborted)
        elif handoff.prefill is not None and not kv_untouched(outcome, routed.stream):
            log.info("request %s: decode worker %s failed (%s) after it may have pulled the KV: the next try "
                     "prefills again", trip.rid, generator.worker_id, outcome.detail)
            self.release_later(trip)
        return generator, outcome

    async def _encode(self, client: Client, trip: Trip, staged: StagePlan, handoff: Handoff,
                      timeouts: Timeouts) -> None:
        """The encode leg: the images' encoder output params into `handoff`; a failure only costs the next
        worker the encoding (it encodes what it cannot fetch, as vLLM's consumer does)."""
        stage = staged.encode
        assert stage is not None
        handoff.encoded = True
        capture = Capture(client.loop)
        routed = trip.routed
        outcome = await self.attempts.run(capture, trip, stage_decision(stage, ENCODE, staged, routed, 0),
                                          encode_body(_payload(routed), trip.served), leg=Leg(ENCODE, timeouts, True))
        params = None
        if isinstance(outcome, Relayed) and outcome.status == 200 and not capture.closed:
            params = answer_params(capture.answer()[1], "ec_transfer_params")
        if params is None:
            detail = outcome.detail if isinstance(outcome, Retryable) else f"HTTP {outcome.status}"
            log.info("request %s: encode worker %s gave no encoder output (%s); the next worker encodes the "
                     "images itself", trip.rid, stage.worker.worker_id, detail)
            if isinstance(outcome, Retryable) and attempt_of(outcome).failure is not None:
                self.registry.record_failure(stage.worker, outcome.detail)
            return
        handoff.encoder, handoff.ec_params = stage.worker.worker_id, params

    async def _prefill(self, client: Client, trip: Trip, staged: StagePlan, handoff: Handoff,
                       timeouts: Timeouts) -> tuple[Worker, Retryable | Relayed] | None:
        """The prefill leg: None once the prefill worker holds the prompt's KV (`handoff` says where and by
        which params); else how it failed (retried by the journey) or the worker's own refusal (relayed)."""
        stage = staged.prefill
        assert stage is not None
        worker = stage.worker
        routed = trip.routed
        capture = Capture(client.loop)
        media = 0 if handoff.ec_params else routed.media_tokens
        outcome = await self.attempts.run(capture, trip, stage_decision(stage, PREFILL, staged, routed, media),
                                          prefill_body(_payload(routed), trip.served, handoff.ec_params),
                                          leg=Leg(PREFILL, timeouts, True))
        if isinstance(outcome, Relayed) and capture.closed:
            outcome = Retryable("broken_body", f"a prefill answer larger than {MAX_CAPTURED_BYTES} bytes")
        if isinstance(outcome, Retryable):
            trip.tried.add(worker.worker_id)  # the next plan prefills elsewhere
            trip.watch.attempts += 1  # a try of the request (the access log's retries)
            return worker, outcome
        head, answer = capture.answer()
        if outcome.status != 200:  # the engine refused the request itself (400 ...): the client's answer
            content_type = header(head, b"content-type") or b"application/json"
            client.write(http.plain_response(outcome.status, answer, content_type,
                                             [(b"x-kvroute-worker", worker.worker_id.encode()),
                                              (b"x-request-id", trip.rid.encode())], client.keep_alive))
            return worker, Relayed(outcome.status, time.monotonic())
        handoff.prefill = worker
        handoff.kv_params = answer_params(answer, "kv_transfer_params")
        return None

    # --- KV nobody will pull ----------------------------------------------------------------------
    def release_later(self, trip: Trip) -> None:
        """Let go of the KV a prefill worker holds for `trip` (the journey gave up on it, or its decode worker
        failed past the point where another may pull it): a release through a decode worker, in the background.
        Connectors that find KV by the prompt (ExampleConnector) hold nothing per request: nothing to do."""
        handoff = trip.handoff
        if handoff is None or handoff.prefill is None:
            return
        params, prefill = handoff.kv_params, handoff.prefill
        handoff.prefill = handoff.kv_params = None
        if not params:
            return
        target = self._release_target(trip.served, trip.tried)
        if target is None or len(self._tasks) >= MAX_RELEASES:
            log.warning("request %s: no decode worker to release the KV %s holds; its lease frees it", trip.rid,
                        prefill.worker_id)
            return
        task = asyncio.get_running_loop().create_task(self._release(target, params, trip.rid, prefill))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release_target(self, served: str, tried: set[str]) -> Worker | None:
        """A decode-capable worker of the model whose connector takes remote KV; one that did not fail first."""
        able = [w for w in self.registry.candidates(served) if w.role in ("decode", "both")
                and w.labels.get("kv_role") != "kv_producer"]
        return next((w for w in able if w.worker_id not in tried), able[0] if able else None)

    async def _release(self, worker: Worker, params: dict[str, Any], rid: str, prefill: Worker) -> None:
        pool = self.attempts.pool
        endpoint = pool.endpoint(worker.url)
        body = release_body(params)
        auth = b"Authorization: Bearer %s\r\n" % worker.api_key.encode() if worker.api_key else b""
        request = b"".join((b"POST ", endpoint.base_path, b"/v1/completions HTTP/1.1\r\nHost: ", endpoint.host_header,
                            b"\r\nContent-Type: application/json\r\nx-request-id: ", rid.encode(),
                            b"\r\nContent-Length: %d\r\n" % len(body), auth, b"\r\n", body))
        capture = Capture(asyncio.get_running_loop())
        try:
            outcome = await Exchange(capture, WHOLE, b"", RELEASE_TIMEOUTS).send(pool, endpoint, request)
        except Exception:  # a background task: its failure is only logged (the lease frees the blocks)
            log.exception("request %s: releasing the KV held on %s failed", rid, prefill.worker_id)
            return
        status = outcome.status if outcome.status else getattr(outcome, "detail", "no answer")
        log.info("request %s: released the KV %s held, through %s (%s)", rid, prefill.worker_id, worker.worker_id,
                 status)


def _payload(routed: RoutedRequest) -> dict[str, Any]:
    """The request every leg is built from: with the media uuids the whole request's body carries
    (proxy/routing/media_ids.py), so each leg's engine keys the images' KV as the others do."""
    return (with_media_uuids(routed.payload) if routed.media_count else None) or routed.payload
