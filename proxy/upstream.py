"""Talking to workers: one pooled client session, forwarding bytes, relaying streams unbuffered.

Owns the aiohttp ClientSession (per-worker connection limits, TCP_NODELAY), the connect /
first-byte / idle timeouts, and what happens when a worker or the client fails mid-request.
It does not choose workers or retry (dispatch.py does): it says whether a retry is possible.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.config import Timeouts
from proxy.errors import error_body
from proxy.registry import Worker
from proxy.security.clientauth import CLIENT_CREDENTIAL_HEADERS

log = logging.getLogger("kvroute.upstream")

# Connections the proxy keeps open to one worker at most; engines batch far fewer than this.
CONNECTIONS_PER_WORKER = 512

_HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Accept-Encoding",
))
_NOT_RELAYED_BACK = _HOP_BY_HOP | {"date", "server", "content-length"}
# A client's credentials are for the proxy alone: a rogue worker must not collect users' keys.
_NOT_FORWARDED = _HOP_BY_HOP | CLIENT_CREDENTIAL_HEADERS
# A broken upstream connection, as opposed to the client going away (ConnectionResetError on write).
_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


@dataclass(slots=True)
class RetryableFailure:
    """Nothing reached the client yet, so another worker may serve the request."""

    reason: str                 # connect_error | first_byte_timeout | status_5xx | status_429 | broken_body
    detail: str
    status: int | None = None   # the worker's HTTP status, when it answered
    body: bytes | None = None
    content_type: str | None = None


@dataclass(slots=True)
class ForwardResult:
    """How a forwarded request ended, for metrics and the circuit breaker."""

    response: web.StreamResponse
    status: int
    first_byte_at: float | None
    worker_failed: bool = False   # the worker broke the stream after the first byte
    client_gone: bool = False


def upstream_headers(client_headers: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop ones and client credentials, plus the request id the worker should log."""
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in client_headers.items():
        if key.lower() not in _NOT_FORWARDED:
            out.add(key, value)
    out["x-request-id"] = request_id
    return out


class Upstream:
    """The shared client side of the proxy; `start()` on app startup, `close()` on cleanup."""

    def __init__(self, timeouts: Timeouts, connections_per_worker: int = CONNECTIONS_PER_WORKER) -> None:
        self.timeouts = timeouts
        self.connections_per_worker = connections_per_worker
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # TCP_NODELAY: aiohttp sets it on every connection it opens (base_protocol.connection_made).
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.connections_per_worker,
                                         keepalive_timeout=60, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited (the app has not started)")
        return self._session

    async def forward(self, worker: Worker, path: str, body: bytes, headers: CIMultiDict[str],
                      client: web.Request, response_headers: dict[str, str],
                      stream: bool) -> ForwardResult | RetryableFailure:
        """Send `body` to `worker` and answer `client`; or say why another worker should try."""
        timeouts = self.timeouts
        # One deadline for the worker's headers and, when streaming, its first chunk.
        first_byte_deadline = asyncio.get_running_loop().time() + timeouts.first_byte_s
        try:
            async with asyncio.timeout_at(first_byte_deadline):
                upstream = await self.session.post(worker.url + path, data=body, headers=headers)
        except TimeoutError:
            return RetryableFailure("first_byte_timeout", f"no answer within {timeouts.first_byte_s}s")
        except (aiohttp.ClientError, OSError) as exc:
            return RetryableFailure("connect_error", f"{type(exc).__name__}: {exc}")

        done = False
        try:
            status = upstream.status
            if status >= 500 or status == 429:
                try:
                    data = await self._read_body(upstream)
                except _UPSTREAM_ERRORS as exc:  # still nothing sent: retry, without a body to pass on
                    return RetryableFailure(f"status_{status}",
                                            f"worker answered HTTP {status}, then {type(exc).__name__}")
                return RetryableFailure(f"status_{status}", f"worker answered HTTP {status}", status,
                                        data, upstream.headers.get("Content-Type"))
            headers = _relayed_headers(upstream.headers, response_headers)
            if not stream or not upstream.content_type.startswith("text/event-stream"):
                try:
                    data = await self._read_body(upstream)
                except _UPSTREAM_ERRORS as exc:
                    return RetryableFailure("broken_body", f"{type(exc).__name__}: {exc}")
                done = True
                return ForwardResult(web.Response(status=status, body=data, headers=headers), status,
                                     time.monotonic())
            # The client's response starts with the worker's first chunk, not its headers: a worker
            # that dies between the two (engines send headers at once) is still retried elsewhere.
            try:
                async with asyncio.timeout_at(first_byte_deadline):
                    first = await upstream.content.readany()
            except _UPSTREAM_ERRORS as exc:
                reason = "first_byte_timeout" if isinstance(exc, TimeoutError) else "broken_before_first_chunk"
                return RetryableFailure(reason, f"{type(exc).__name__} before the first chunk")
            result = await self._relay_stream(upstream, client, status, headers, first)
            done = not (result.worker_failed or result.client_gone)
            return result
        finally:
            # A finished response goes back to the pool; anything else closes the connection so
            # the worker sees the client leave and stops generating.
            if done:
                upstream.release()
            else:
                upstream.close()

    async def _read_body(self, upstream: aiohttp.ClientResponse) -> bytes:
        async with asyncio.timeout(self.timeouts.idle_s):
            return await upstream.read()

    async def _relay_stream(self, upstream: aiohttp.ClientResponse, client: web.Request, status: int,
                            headers: CIMultiDict[str], first: bytes) -> ForwardResult:
        response = web.StreamResponse(status=status, headers=headers)
        try:
            await response.prepare(client)
            if first:
                await response.write(first)
        except ConnectionResetError:
            return ForwardResult(response, status, None, client_gone=True)
        first_byte_at = time.monotonic()
        ends_clean = first.endswith(b"\n\n") or not first
        idle_s = self.timeouts.idle_s
        content = upstream.content
        while first:
            try:
                async with asyncio.timeout(idle_s):
                    chunk = await content.readany()
            except _UPSTREAM_ERRORS as exc:
                reason = "idle_timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
                log.warning("worker stream broke after the first byte (%s); ending the client's stream", reason)
                client_gone = not await _end_stream_with_error(response, ends_clean, reason)
                return ForwardResult(response, status, first_byte_at, worker_failed=True, client_gone=client_gone)
            if not chunk:
                break
            if not await _write_or_drop(client, response, chunk, idle_s):
                return ForwardResult(response, status, first_byte_at, client_gone=True)
            ends_clean = chunk.endswith(b"\n\n")
        if not await _write_or_drop(client, response, None, idle_s):
            return ForwardResult(response, status, first_byte_at, client_gone=True)
        return ForwardResult(response, status, first_byte_at)


async def _write_or_drop(client: web.Request, response: web.StreamResponse, data: bytes | None,
                         timeout_s: float) -> bool:
    """Write a chunk (None: end the response). False when the client left, or stopped reading for
    `timeout_s` (a stalled reader must not hold the worker's slot forever): its connection is closed."""
    try:
        async with asyncio.timeout(timeout_s):
            if data is None:
                await response.write_eof()
            else:
                await response.write(data)
        return True
    except ConnectionResetError:
        return False
    except TimeoutError:
        log.warning("client stopped reading for %.0fs; dropping its stream", timeout_s)
        if client.transport is not None:
            client.transport.abort()
        return False


async def _end_stream_with_error(response: web.StreamResponse, ends_clean: bool, reason: str) -> bool:
    """Close an SSE stream the worker broke: an error event, then [DONE]. False if the client left."""
    event = orjson.dumps(error_body(f"The worker serving this request failed mid-stream ({reason}).",
                                    "server_error", code="worker_failed"))
    try:
        await response.write((b"" if ends_clean else b"\n\n") + b"data: " + event + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        return False
    return True


def _relayed_headers(upstream_headers: CIMultiDictProxy[str], extra: dict[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in upstream_headers.items():
        if key.lower() not in _NOT_RELAYED_BACK and key.lower() not in ("x-request-id", "x-kvroute-worker"):
            out.add(key, value)
    out.update(extra)
    return out
