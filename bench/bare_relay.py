"""The floor of a Python relay, for `kvroute bench overhead` only: round robin over the workers, nothing else.

Issue 10 quotes a 320-line prototype (uvloop + httptools, raw asyncio Protocols) at 0.60x
vllm-router's CPU per streamed request. This module rebuilds that design so the floor can be
measured on the machine at hand, in the same run as kvroute and the peers (route `bare-relay:round_robin`):

- client requests are parsed with httptools only to find where each one ends; the original bytes
  are forwarded unchanged over a pooled keep-alive connection to the next worker in turn;
- the worker's answer is written to the client as it arrives, framing untouched, and fed to an
  httptools response parser only to learn where it ends (then the connection goes back to the pool);
- back-pressure: a client whose transport pauses writing pauses the upstream read.

It has none of a proxy's duties: no routing, timeouts, retries, error answers, metrics,
limits or pipelining (one request at a time per client connection). It is a measuring stick,
never a product path. GET /health is answered locally so the bench can wait for it.

    python -m bench.bare_relay --port 8000 http://127.0.0.1:8001 http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from urllib.parse import urlsplit

import httptools
import uvloop

HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok"


class Upstream(asyncio.Protocol):
    """One keep-alive connection to a worker; relays one response at a time to `client`."""

    def __init__(self, pool: list[Upstream]) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, client: Client, request: bytes) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:
            return
        client.transport.write(data)
        self.parser.feed_data(data)  # may call on_message_complete

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if self.closed or not self.parser.should_keep_alive():  # the worker ends this connection: not reusable
            self.closed = True
            self.transport.close()
        else:
            self.pool.append(self)
        client.response_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:  # worker went away mid-answer: the client connection cannot be framed
            self.client.transport.close()
            self.client = None


class Client(asyncio.Protocol):
    """One client connection: parse a request, hand its bytes to an upstream, wait, repeat."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.buf: list[bytes] = []
        self.url = b""
        self.upstream: Upstream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf.append(data)
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        request, self.buf, url, self.url = b"".join(self.buf), [], self.url, b""
        if url == b"/health":
            self.transport.write(HEALTH)
            return
        self.transport.pause_reading()  # one request at a time
        asyncio.ensure_future(self.relay.send(self, request))

    def response_done(self) -> None:
        self.upstream = None
        if not self.parser.should_keep_alive():
            self.transport.close()
        else:
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:  # abandoned answer: the upstream connection cannot be reused
            self.upstream.client = None
            self.upstream.closed = True
            self.upstream.transport.close()


class Relay:
    def __init__(self, workers: list[str]) -> None:
        self.addrs = [(u.hostname, u.port) for u in map(urlsplit, workers)]
        self.pools: list[list[Upstream]] = [[] for _ in self.addrs]
        self.turn = itertools.cycle(range(len(self.addrs)))

    async def send(self, client: Client, request: bytes) -> None:
        i = next(self.turn)
        pool = self.pools[i]
        if pool:
            up = pool.pop()
        else:
            _, up = await asyncio.get_running_loop().create_connection(lambda: Upstream(pool), *self.addrs[i])
        client.upstream = up
        up.start(client, request)


async def serve(port: int, workers: list[str]) -> None:
    relay = Relay(workers)
    server = await asyncio.get_running_loop().create_server(lambda: Client(relay), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("workers", nargs="+")
    args = p.parse_args()
    uvloop.run(serve(args.port, args.workers))


if __name__ == "__main__":
    main()
