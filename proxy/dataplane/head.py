"""The request head every attempt of one request sends its worker: first attempts, retries and continuations.

Owns which client headers a worker gets (hop-by-hop ones, client credentials and replaced ones dropped),
the proxy's own (x-request-id, the x-kvroute-via chain, the traceparent of the attempt, the worker's own
key) and the request line for the worker's URL; built once per request, completed per attempt.
"""

from __future__ import annotations

from proxy.dataplane import http
from proxy.dataplane.identity import VIA_HEADER, via_chain
from proxy.dataplane.incoming import IncomingRequest
from proxy.dataplane.pool import Endpoint
from proxy.workers.registry import Worker

# Request headers a worker never gets from the client (besides hop-by-hop ones).
TO_WORKER_DROP = http.CLIENT_CREDENTIALS | http.TO_WORKER_REPLACED


class UpstreamHead:
    """The client's header lines as a worker gets them, serialised once; `to()` completes them per attempt."""

    __slots__ = ("url", "common")

    def __init__(self, req: IncomingRequest, rid: str, instance_id: str, replaced: frozenset[bytes]) -> None:
        """`replaced`: more headers the worker gets from the proxy instead (the traceparent when traced)."""
        self.url = req.url
        drop = TO_WORKER_DROP | replaced if replaced else TO_WORKER_DROP
        named = http.connection_named(req.headers) if req.header(b"connection") is not None else None
        self.common = b"".join((
            http.filtered(req.headers, http.HOP_BY_HOP, drop | named if named else drop),
            b"x-request-id: ", rid.encode(), b"\r\nx-kvroute-via: ",
            via_chain(req.header(VIA_HEADER), instance_id), b"\r\n"))

    def to(self, endpoint: Endpoint, worker: Worker, trace_line: bytes, body: bytes) -> bytes:
        """The whole request for `worker` at `endpoint`: head and `body`."""
        api_key = worker.api_key
        return b"".join((b"POST ", endpoint.base_path, self.url, b" HTTP/1.1\r\nHost: ", endpoint.host_header,
                         b"\r\n", self.common, b"Content-Length: %d\r\n" % len(body), trace_line,
                         b"Authorization: Bearer %s\r\n" % http.safe_value(api_key) if api_key else b"", b"\r\n", body))
