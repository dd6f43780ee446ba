"""The fleet manager's view of the proxy's control plane over HTTP: list workers, drain, deregister.

Owns only the HTTP calls and the tolerant reading of `GET /workers`; going through HTTP (not
the registry object) means the same code works against a proxy in another process.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

log = logging.getLogger("kvroute.fleet")


def workers_by_id(body: Any) -> dict[str, dict[str, Any]]:
    """`GET /workers` body -> {worker_id: record}; accepts a list or {"workers": [...]} / {"data": [...]}."""
    if isinstance(body, dict):
        body = body.get("workers", body.get("data", []))
    out: dict[str, dict[str, Any]] = {}
    for rec in body if isinstance(body, list) else []:
        if isinstance(rec, dict):
            wid = rec.get("worker_id") or rec.get("id")
            if wid:
                out[str(wid)] = rec
    return out


def record_state(rec: dict[str, Any]) -> str:
    return str(rec.get("state") or rec.get("status") or "unknown")


class ProxyControl:
    def __init__(self, base_url: str, admin_token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=5, connect=2))
        return self._session

    async def workers(self) -> dict[str, dict[str, Any]]:
        async with self._client().get(f"{self.base_url}/workers") as resp:
            resp.raise_for_status()
            return workers_by_id(await resp.json(content_type=None))

    async def drain(self, worker_id: str) -> bool:
        """Tell the proxy to send this worker nothing new. False when the proxy does not know it."""
        try:
            async with self._client().post(f"{self.base_url}/workers/{worker_id}/drain") as resp:
                if resp.status >= 400 and resp.status != 404:
                    log.warning("drain %s: proxy answered %s", worker_id, resp.status)
                return resp.status < 300
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("drain %s: %s", worker_id, exc)
            return False

    async def deregister(self, worker_id: str) -> None:
        """Forget a worker that is gone (it deregisters itself when it exits cleanly; a crash does not)."""
        try:
            async with self._client().delete(f"{self.base_url}/workers/{worker_id}") as resp:
                if resp.status >= 400 and resp.status != 404:
                    log.warning("deregister %s: proxy answered %s", worker_id, resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("deregister %s: %s", worker_id, exc)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
