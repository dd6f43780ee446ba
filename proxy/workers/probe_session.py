"""The proxy's aiohttp client session for talking to workers outside the data plane: health probes,
/metrics scrapes and the /v1/models probe of a registration (proxy/workers/monitor.py).

Owns the session's life (`start()` on app startup, `close()` on cleanup) and its connector settings; not
forwarding requests, which is proxy/dataplane/'s alone.
"""

from __future__ import annotations

import aiohttp

from proxy.config import Timeouts

# Connections kept open to one worker at most: probes and scrapes go one at a time per worker.
CONNECTIONS_PER_WORKER = 16


class Upstream:
    """The shared client session for probes; `start()` on app startup, `close()` on cleanup."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=CONNECTIONS_PER_WORKER, keepalive_timeout=60,
                                         ttl_dns_cache=300)
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
