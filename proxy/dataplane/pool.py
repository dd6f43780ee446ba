"""Keep-alive connections to workers (and to the control-plane app): one free list per endpoint.

Owns connecting (TCP_NODELAY, TLS for https workers, a unix socket for the internal app),
reuse and discarding of connections; what travels over one is exchange.py's, which it tells
through the UpstreamListener protocol.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

# A pooled connection idle longer than this is closed rather than reused: engines' HTTP servers
# (uvicorn) drop keep-alive connections after 5 s, and a request written into a closing one is lost.
POOL_IDLE_S = 4.0
# Free connections kept per endpoint; more than engines batch at once.
MAX_FREE_PER_ENDPOINT = 512


class UpstreamListener(Protocol):
    """What a connection tells the exchange it carries (exchange.py's Exchange)."""

    def upstream_data(self, data: bytes) -> None: ...

    def upstream_eof(self) -> None: ...

    def upstream_lost(self, exc: Exception | None) -> None: ...


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a worker listens, parsed once from its URL."""

    host: str
    port: int
    tls: bool
    base_path: bytes     # a URL path prefix the worker was registered with ("" usually)
    host_header: bytes
    unix_path: str | None = None

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = parts.hostname or "127.0.0.1"
        return cls(host, port, tls, parts.path.rstrip("/").encode(), parts.netloc.encode())

    @classmethod
    def unix(cls, path: str) -> Endpoint:
        return cls("localhost", 0, False, b"", b"localhost", unix_path=path)


class UpstreamConnection(asyncio.Protocol):
    """One connection to an endpoint; carries one exchange at a time."""

    __slots__ = ("pool", "endpoint", "transport", "exchange", "reused", "idle_since", "closed")

    def __init__(self, pool: UpstreamPool, endpoint: Endpoint) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.exchange: UpstreamListener | None = None
        self.reused = False
        self.idle_since = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # nothing was asked: the connection is out of step, drop it
            self.transport.abort()
            return
        exchange.upstream_data(data)

    def eof_received(self) -> bool:
        exchange = self.exchange
        if exchange is not None:
            exchange.upstream_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        exchange = self.exchange
        if exchange is not None:
            exchange.upstream_lost(exc)

    def pause_writing(self) -> None:  # request bodies are written whole; the transport buffers them
        pass

    def resume_writing(self) -> None:
        pass

    def close(self) -> None:
        self.exchange = None
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            self.transport.abort()


class UpstreamPool:
    """Free keep-alive connections per endpoint, most recently used first."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop  # the loop the connections live on (asyncio.get_running_loop() costs a getpid())
        self._free: dict[Endpoint, dict[UpstreamConnection, None]] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._tls: ssl.SSLContext | None = None
        self._closing = False

    def endpoint(self, url: str) -> Endpoint:
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            if len(self._endpoints) > 4096:  # workers come and go; the cache is only a shortcut
                self._endpoints.clear()
            endpoint = self._endpoints[url] = Endpoint.from_url(url)
        return endpoint

    def take(self, endpoint: Endpoint, now: float) -> UpstreamConnection | None:
        """A free connection to `endpoint` that is still fresh at loop time `now`, or None."""
        free = self._free.get(endpoint)
        while free:
            conn, _ = free.popitem()
            if not conn.closed and now - conn.idle_since < POOL_IDLE_S:
                conn.reused = True
                return conn
            conn.close()
        return None

    async def connect(self, endpoint: Endpoint, connect_s: float) -> UpstreamConnection:
        """A new connection to `endpoint` (OSError/TimeoutError)."""
        loop = asyncio.get_running_loop()
        conn = UpstreamConnection(self, endpoint)
        async with asyncio.timeout(connect_s):
            if endpoint.unix_path is not None:
                await loop.create_unix_connection(lambda: conn, endpoint.unix_path)
            else:
                tls = None
                if endpoint.tls:
                    if self._tls is None:
                        self._tls = ssl.create_default_context()
                    tls = self._tls
                await loop.create_connection(lambda: conn, endpoint.host, endpoint.port, ssl=tls,
                                             server_hostname=endpoint.host if tls else None)
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """A connection whose exchange finished cleanly and may carry another."""
        conn.exchange = None
        if conn.closed or self._closing:
            conn.close()
            return
        free = self._free.setdefault(conn.endpoint, {})
        if len(free) >= MAX_FREE_PER_ENDPOINT:
            conn.close()
            return
        conn.idle_since = (self._loop or asyncio.get_running_loop()).time()
        free[conn] = None

    def forget(self, conn: UpstreamConnection) -> None:
        free = self._free.get(conn.endpoint)
        if free is not None:
            free.pop(conn, None)

    def close(self) -> None:
        self._closing = True
        for free in list(self._free.values()):
            for conn in list(free):
                conn.close()
        self._free.clear()
