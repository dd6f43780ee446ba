"""The first stage of a completion's journey: from a parsed HTTP request to a Trip ready to route.

Owns, in order: the client's credentials, loop detection (508), parsing the body (large ones off the event
loop), which model the name means (404), the request-shape limits (400), the media URLs an engine may fetch
(400), the client's own rate and token limits (429), and then what routing needs: the policy, the upstream
head, whether the stream may migrate. Nothing here talks to a worker.
"""

from __future__ import annotations

import asyncio

from proxy.dataplane import migration
from proxy.dataplane.classify import RetryBudget
from proxy.dataplane.head import UpstreamHead
from proxy.dataplane.identity import VIA_HEADER, refuse_loop
from proxy.dataplane.outcome import STREAM, WHOLE
from proxy.dataplane.trip import Trip
from proxy.observability.metrics import ProxyMetrics
from proxy.request import CHAT, RoutedRequest, parse_request
from proxy.routing.live import LiveConfig
from proxy.routing.media_ids import body_with_media_uuids
from proxy.routing.service import RoutingService
from proxy.security.clientauth import ClientAuth
from proxy.security.limits import check_request
from proxy.security.media_urls import MediaUrlGuard

# Bodies larger than this are parsed in a worker thread: validating a 32 MB prompt of token ids is
# a second of Python that would otherwise stall every other request on the loop.
PARSE_IN_THREAD_BYTES = 1024 * 1024


class Intake:
    """Admits a request (or raises the ProxyError that answers it) and prepares its trip."""

    def __init__(self, live: LiveConfig, routing: RoutingService, client_auth: ClientAuth, metrics: ProxyMetrics,
                 instance_id: str) -> None:
        self.live = live
        self.routing = routing
        self.client_auth = client_auth
        self.metrics = metrics
        self.instance_id = instance_id
        self.media_urls = MediaUrlGuard()

    async def admit(self, trip: Trip) -> None:
        req = trip.req
        if req.refusal is not None:
            raise req.refusal
        # Client authentication (proxy/security/clientauth.py): the connection already ran it on the head,
        # before reading the body; here is its principal.
        principal = req.principal or self.client_auth.authenticate(req.header(b"authorization"))
        refuse_loop(req.header(VIA_HEADER), self.instance_id)
        body = req.body()
        session = req.header(b"x-session-id")
        session_key = session.decode("latin-1") if session is not None else None
        if len(body) > PARSE_IN_THREAD_BYTES:
            routed = await asyncio.to_thread(parse_request, body, req.kind, session_key)
        else:
            routed = parse_request(body, req.kind, session_key)
        trip.model_label = self.metrics.model_label(routed.model)
        served = self.routing.resolve_model(routed.model)
        trip.model_label = served
        await self.routing.tokenizers.count(routed, served)  # the engine's own count where it matters
        trip.watch.parsed(served, routed.stream, principal, routed.prompt_tokens)
        check_request(routed, self.live.config, served)
        if routed.media_count:  # no engine is made to fetch from the fleet's own networks
            await self.media_urls.check(routed.payload, self.live.proxy.media_urls)
        await self.client_auth.admit(principal, served, routed.expected_kv_tokens)
        self._prepare(trip, routed, served)

    def _prepare(self, trip: Trip, routed: RoutedRequest, served: str) -> None:
        """What every attempt of the trip shares."""
        trip.routed = routed
        trip.served = served
        trip.policy = self.routing.policy_for(served)
        # an inline image goes upstream with its name (`uuid`), so the engine keys its KV blocks as the proxy does
        trip.body = body_with_media_uuids(routed, served) if routed.media_count else routed.body_for_model(served)
        trip.head = UpstreamHead(trip.req, trip.rid, self.instance_id, trip.watch.replaces)
        trip.mode = STREAM if routed.stream else WHOLE
        trip.tracker = self._tracker(routed)
        trip.tried = set()
        trip.budget = RetryBudget(self.live.proxy.retries)

    def _tracker(self, routed: RoutedRequest) -> migration.StreamTracker | None:
        """A stream that may migrate gets its events read; any other keeps the plain byte relay."""
        if not routed.stream or self.live.proxy.migrations < 1:
            return None
        if migration.refusal(routed.payload, routed.kind) is not None:
            return None
        options = routed.payload.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return migration.StreamTracker(routed.kind == CHAT, include_usage,
                                       self.live.proxy.limits.max_migration_text_bytes)
