"""The one question the stall rule asks a worker that went quiet: does its engine still answer, and did it move?

Owns a single bounded GET of the worker's `/metrics` on the shared probe session (proxy/workers/probe_session.py): any HTTP
answer in time means the process lives; a readable one also hands its work counters to the registry
(registry.record_probe_reading), so an engine that moved is seen to. When to ask is proxy/dataplane/stall.py's;
periodic probes and scrapes are proxy/workers/monitor.py's.
"""

from __future__ import annotations

import logging

import aiohttp

from proxy.workers.engine_metrics import parse_engine_metrics
from proxy.workers.probe_session import Upstream
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.monitor")

# The most of an answer read: vLLM's whole /metrics is ~50 KB; a worker must not make the proxy hold more.
MAX_PROBE_BYTES = 2 * 1024 * 1024


class EngineProbe:
    """`await probe(worker, timeout_s)`: True when `worker`'s engine answered within `timeout_s`."""

    def __init__(self, registry: Registry, upstream: Upstream) -> None:
        self.registry = registry
        self.upstream = upstream

    async def __call__(self, worker: Worker, timeout_s: float) -> bool:
        try:
            # never follow a redirect: a worker URL must not become a way to make the proxy fetch another address
            async with self.upstream.session.get(worker.url + "/metrics", allow_redirects=False,
                                                 timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await _read_bounded(resp) if resp.status == 200 else b""
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.info("probe of %s got no answer within %.1fs: %s", worker.worker_id, timeout_s, type(exc).__name__)
            return False
        reading = parse_engine_metrics(body.decode("utf-8", errors="replace")) if body else None
        if reading is not None:
            self.registry.record_probe_reading(worker, reading)
        return True


async def _read_bounded(resp: aiohttp.ClientResponse) -> bytes:
    """The body up to MAX_PROBE_BYTES (what is past it is left unread: the connection is then dropped)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size >= MAX_PROBE_BYTES:
            break
    return b"".join(chunks)
