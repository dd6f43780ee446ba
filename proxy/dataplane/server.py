"""The proxy's public port: the listener, and which part answers each request that arrives on it.

Owns the server's life (listen, pause and resume accepting when gate.py says, refuse new completions while
stopping, close), the canned answers its connections send, and the hand-off of each request: a /v1
completion to the journey (journey.py), a worker's own load report answered here (reports.py), anything
else relayed byte for byte to the aiohttp control-plane app on an internal socket. One connection's HTTP
is connection.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Coroutine
from typing import Any

from proxy.dataplane import http
from proxy.dataplane.budget import BodyBudget
from proxy.dataplane.connection import ClientConnection
from proxy.dataplane.exchange import Exchange
from proxy.dataplane.gate import ConnectionGate
from proxy.dataplane.identity import client_request_id, new_instance_id
from proxy.dataplane.incoming import IncomingRequest
from proxy.dataplane.journey import Journey
from proxy.dataplane.outcome import PASS, Retryable
from proxy.dataplane.pool import Endpoint, UpstreamPool
from proxy.dataplane.reports import answer_report, report_worker_id
from proxy.dataplane.stall import EngineProbe
from proxy.errors import ProxyError, shutting_down
from proxy.observability.metrics import ProxyMetrics
from proxy.routing.live import LiveConfig
from proxy.routing.service import RoutingService
from proxy.security.clientauth import ClientAuth
from proxy.workers.registry import Registry

log = logging.getLogger("kvroute.dataplane")

# The internal hop to the control-plane app: local, and it serves a long-lived event stream.
INTERNAL_IDLE_S = 24 * 3600.0


class DataPlane:
    """The public server: client connections, the upstream pool, the journey and the internal hop."""

    def __init__(self, live: LiveConfig, routing: RoutingService, registry: Registry, metrics: ProxyMetrics,
                 client_auth: ClientAuth, internal_socket: str, hop_secret: str, *, probe: EngineProbe) -> None:
        proxy_cfg = live.proxy  # limits and timeouts of the internal hop: read once (not live keys)
        self.loop = asyncio.get_running_loop()
        self.limits = proxy_cfg.limits
        self.max_body = proxy_cfg.max_body_bytes
        self.client_auth = client_auth
        self.registry = registry
        self.pool = UpstreamPool(self.loop)
        self.journey = Journey(live, routing, client_auth, registry, metrics, self.pool, new_instance_id(),
                               probe=probe)  # the stall rule's question to a quiet worker (proxy/workers/engine_probe.py)
        self.internal = Endpoint.unix(internal_socket)
        self.internal_timeouts = proxy_cfg.timeouts.model_copy(update={"idle_s": INTERNAL_IDLE_S, "total_s": None})
        self.hop_secret = hop_secret.encode()
        self.gate = ConnectionGate(self.loop, self.limits, metrics, self)
        self.connections = self.gate.connections
        self.body_budget = BodyBudget(self.limits.max_buffered_body_bytes, self.limits.buffered_body_wait_s)
        self.servers: list[asyncio.Server] = []
        self.listening: list[int] = []  # our own descriptors of the listening sockets: kept while accepting pauses
        self.resuming: asyncio.Task[None] | None = None
        self.closing = False
        self.shutting_down = False  # set by begin_shutdown(): new completions get 503 shutting_down
        self.shutting_down_response = http.error_response(shutting_down(), {}, False)
        self.refused = http.error_response(
            ProxyError(503, "The proxy has as many client connections open as it may.", "service_unavailable",
                       code="too_many_connections", headers={"Retry-After": "1"}), {}, False)
        self.refused_client = http.error_response(
            ProxyError(429, f"This client address has {self.limits.max_connections_per_client} connections open, as "
                            "many as the proxy allows one client (proxy.limits.max_connections_per_client).",
                       "rate_limit_exceeded", code="too_many_connections_from_client", headers={"Retry-After": "1"}),
            {}, False)
        self.header_timeout = http.error_response(
            ProxyError(408, f"The request headers did not arrive within {self.limits.header_read_timeout_s:g}s.",
                       code="header_timeout"), {}, False)
        self.body_timeout = http.error_response(
            ProxyError(408, f"The request body did not arrive within {self.limits.body_read_timeout_s:g}s.",
                       code="body_timeout"), {}, False)

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port; the bound port."""
        server = await self.loop.create_server(lambda: ClientConnection(self), host, port, backlog=1024,
                                               reuse_address=True)
        self.servers = [server]
        self.listening = [os.dup(sock.fileno()) for sock in server.sockets]
        return server.sockets[0].getsockname()[1]

    def pause_accepting(self) -> None:
        """Stop accepting: the servers close, but the listening sockets stay open through our own descriptors of
        them, so the kernel goes on queueing new connections (up to the backlog) instead of refusing them."""
        for server in self.servers:
            server.close()
        self.servers = []

    def resume_accepting(self) -> None:
        self.resuming = self.loop.create_task(self._accept_again())

    async def _accept_again(self) -> None:
        for fd in self.listening[len(self.servers):]:
            if self.closing or self.gate.paused_since is not None:
                return
            try:
                server = await self.loop.create_server(lambda: ClientConnection(self),
                                                       sock=socket.socket(fileno=os.dup(fd)), backlog=1024)
            except OSError:  # no descriptor to spare yet, say: try again shortly
                log.exception("could not accept connections again; retrying in 1s")
                self.loop.call_later(1.0, self.resume_accepting)
                return
            if self.closing or self.gate.paused_since is not None:  # paused again meanwhile
                server.close()
                return
            self.servers.append(server)

    def begin_shutdown(self) -> None:
        """From now on new completions are refused (503 shutting_down, connection closed); those in flight
        go on. The listener stays open so a client learns why instead of seeing a refused connection."""
        self.shutting_down = True

    async def close(self) -> None:
        self.closing = True
        self.pause_accepting()
        for fd in self.listening:
            os.close(fd)
        self.listening = []
        for conn in list(self.connections):
            conn.abort()
        self.pool.close()
        await asyncio.to_thread(self.journey.observer.close)  # spans still queued go to the collector

    def answer(self, conn: ClientConnection, req: IncomingRequest) -> Coroutine[Any, Any, None] | None:
        """Answer `req`, `conn`'s next complete request: refusals and a worker's own load report at once
        (None), a completion through the journey, anything else through the control-plane app."""
        if req.kind is not None and self.shutting_down:
            conn.keep_alive = False
            conn.write(self.shutting_down_response)
            self.journey.observer.refused(req, 503, "shutting_down", client_request_id(req.header(b"x-request-id")))
            conn.response_done()
            return None
        if req.refusal is not None and req.refusal_direct:
            conn.keep_alive = False
            conn.write(http.error_response(req.refusal, {}, False))
            if req.kind is not None:  # a completion refused on its head (401, 413, 431, 408...): logged too
                self.journey.observer.refused(req, req.refusal.status, req.refusal.code,
                                              client_request_id(req.header(b"x-request-id")))
            conn.response_done()
            return None
        if req.kind is None and (worker_id := report_worker_id(req.method, req.url)) is not None:
            answer = answer_report(self.registry, worker_id, req.header(b"authorization"), req.body(),
                                   conn.keep_alive)
            if answer is not None:  # a worker's own report, recorded: no hop to the control plane
                conn.write(answer)
                conn.response_done()
                return None
        return self.journey.serve(conn, req) if req.kind is not None else self.passthrough(conn, req)

    async def passthrough(self, client: ClientConnection, req: IncomingRequest) -> None:
        """Hand a non-completion request to the control-plane app, as sent, and relay its answer."""
        try:
            head = b"".join((
                req.method, b" ", req.url, b" HTTP/1.1\r\n",
                http.filtered(req.headers, http.HOP_BY_HOP, http.connection_named(req.headers) | http.INTERNAL_HOP),
                b"x-kvroute-client-addr: ", client.peer, b"\r\nx-kvroute-hop-secret: ", self.hop_secret,
                b"\r\nContent-Length: %d\r\n\r\n" % req.size))
            exchange = Exchange(client, PASS, b"", self.internal_timeouts, head_request=req.method == b"HEAD")
            outcome = await exchange.send(self.pool, self.internal, head + req.body())
            if isinstance(outcome, Retryable):
                log.error("the control-plane app did not answer: %s", outcome.detail)
                client.write(http.error_response(
                    ProxyError(502, "The proxy's control plane did not answer.", "server_error",
                               code="control_plane_unavailable"), {}, client.keep_alive))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error relaying %s", req.url.decode("latin-1"))
            client.abort()
            return
        client.response_done()
