"""The worker's side of the control path: register with the proxy, report load as often as it asks, deregister.

Engine-agnostic: an engine adapter hands it a `LoadSource` (an async callable that
returns the current load); this module owns retries, re-registration and the report
cadence, not how the load is measured.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from proxy.kvevents import KvEventBatch
from proxy.protocol import REPORT_INTERVAL_MAX_S, WORKER_SECRET_HEADER, LoadReport, WorkerRegistration
from proxy.security.redact import redact_text

log = logging.getLogger("kvroute.reporter")


@dataclass
class Load:
    """One reading of an engine's load, as the adapter measured it."""

    kv_cache_usage: float
    num_running: int
    num_waiting: int
    prefix_cache_hit_rate: float = 0.0
    kv_capacity_tokens: int | None = None  # None: keep the registration's value
    kv_block_size: int | None = None  # tokens per KV block, where the engine says (its KV events' block hashes)
    # the engine's recent speed, when the adapter can measure it (wall-clock seconds; None: unknown)
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    # the engine's token budget per scheduler step (vLLM --max-num-batched-tokens), when the adapter knows it
    max_num_batched_tokens: int | None = None
    # the engine's cumulative work counters (protocol.LoadReport's), when it exposes them
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    preemptions_total: float | None = None


LoadSource = Callable[[], Awaitable[Load]]
# Called (as its own task) after each registration: (session, proxy URL, worker id, the worker's own credentials).
OnRegistered = Callable[[aiohttp.ClientSession, str, str, dict[str, str]], Awaitable[None]]


class KvBatchSource(Protocol):
    """Where a report's KV-event batch comes from (backends/kv_mirror.py's KvMirror)."""

    def take_batch(self) -> KvEventBatch | None: ...

    def resync(self) -> None:
        """The next batch must be a snapshot (the proxy asked, or a batch may have been lost)."""

# The fastest report cadence a proxy can ask for.
MIN_INTERVAL_S = 0.01
# Reports that fail to connect in a row before the worker moves to the next of its proxies.
FAILOVER_AFTER_FAILURES = 2
# A report that takes longer than this counts as failed: two of them in a row move the worker to the next
# proxy, so a cut-off proxy is left in about 2 s (the stale window) instead of 2 x the 5 s session timeout.
REPORT_TIMEOUT = aiohttp.ClientTimeout(total=1.0, connect=0.5)


def parse_proxy_urls(values: str | Sequence[str] | None) -> list[str]:
    """`--proxy-url` values (repeated, or comma-separated) as a list of base URLs, in the order given."""
    if values is None:
        return []
    items = [values] if isinstance(values, str) else list(values)
    urls = [u.strip().rstrip("/") for item in items for u in item.split(",")]
    return list(dict.fromkeys(u for u in urls if u))


class ProxyReporter:
    """Keeps one worker registered with a proxy (one of several replicas) and feeds it load reports.

    Registration is retried with capped exponential backoff for as long as the worker
    lives (LMDeploy registers once and gives up; we do not). A report answered 404 means
    the proxy forgot us (it restarted, or an operator removed us): register again.

    Credentials: the worker token (if any) registers; the proxy answers with a secret for this
    worker alone, which then authorizes its reports, its state changes and its deregistration.
    """

    def __init__(self, proxy_url: str | Sequence[str], registration: WorkerRegistration, load_source: LoadSource,
                 token: str | None = None, interval_s: float = REPORT_INTERVAL_MAX_S,
                 kv_events: KvBatchSource | None = None, on_registered: OnRegistered | None = None) -> None:
        # Several proxies (replicas sharing Redis): talk to one, move to the next when it stops answering.
        self.proxy_urls = parse_proxy_urls(proxy_url)
        if not self.proxy_urls:
            raise ValueError("no proxy URL given")
        self._current = 0
        if registration.boot_id is None:  # new at every start: the proxies restart this worker's seq
            registration = registration.model_copy(update={"boot_id": uuid.uuid4().hex})
        self.registration = registration
        self.load_source = load_source
        self.kv_events = kv_events  # the engine's cache changes ride in the reports (docs/design/kv-events.md)
        # the proxy says how often it wants reports (its answers to registration and to each report, scaled to
        # the fleet's size); `interval_s` is the slowest this worker reports whatever it says
        self.max_interval_s = self.interval_s = interval_s
        self.state = "ready"
        self.worker_id: str | None = registration.worker_id
        self.registered = asyncio.Event()
        self._register_headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._secret: str | None = None  # from the proxy's answer to our registration
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._on_registered = on_registered  # e.g. the tokenizer hand-over (backends/tokenizer_handover.py)
        self._after_register: asyncio.Task[None] | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5, connect=2)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._run(), name="kvroute-reporter")

    async def _register(self) -> None:
        assert self._session is not None
        backoff = 0.2
        while True:
            try:
                headers = dict(self._register_headers)
                if self._secret:  # proves this id is ours if the proxy still holds it
                    headers[WORKER_SECRET_HEADER] = self._secret
                async with self._session.post(f"{self.proxy_url}/workers", headers=headers,
                                              json=self.registration.model_dump(mode="json")) as resp:
                    if resp.status == 200:
                        body = await resp.json()
                        self.worker_id = body["worker_id"]
                        self._secret = body.get("worker_secret") or None
                        self._seq = 0  # a new registration starts a new sequence
                        self._adopt_interval(body)
                        if self.kv_events is not None:
                            self.kv_events.resync()  # this proxy (or a restarted one) may know nothing yet
                        log.info("registered with %s as %s", redact_text(self.proxy_url), self.worker_id)
                        self.registered.set()
                        if self._on_registered is not None:  # its own task: reports go on meanwhile
                            if self._after_register is not None:
                                self._after_register.cancel()
                            self._after_register = asyncio.create_task(self._on_registered(
                                self._session, self.proxy_url, self.worker_id, self._own_headers()))
                        return
                    text = await resp.text()
                    log.warning("proxy refused registration (%s): %s", resp.status, text[:200])
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.info("proxy %s not reachable (%s)", redact_text(self.proxy_url), exc)
                if self._next_proxy():
                    continue  # try the next proxy at once; back off once all of them failed in a row
            except Exception:  # an answer it cannot read (not a proxy's): a worker never stops trying to register
                log.exception("registering with %s failed", redact_text(self.proxy_url))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    @property
    def proxy_url(self) -> str:
        return self.proxy_urls[self._current]

    def _next_proxy(self) -> bool:
        """Move on to the next proxy URL; False when that wraps around to the first (or there is one)."""
        if len(self.proxy_urls) == 1:
            return False
        self._current = (self._current + 1) % len(self.proxy_urls)
        return self._current != 0

    async def _send_report(self) -> bool:
        """Send one report; False when the proxy no longer knows this worker."""
        assert self._session is not None and self.worker_id is not None
        load = await self.load_source()
        self._seq += 1
        batch = self.kv_events.take_batch() if self.kv_events is not None else None
        report = LoadReport(
            worker_id=self.worker_id, url=self.registration.url, models=self.registration.models,
            engine=self.registration.engine, state=self.state,  # type: ignore[arg-type]
            role=self.registration.role, kv_cache_usage=min(max(load.kv_cache_usage, 0.0), 1.0),
            kv_capacity_tokens=load.kv_capacity_tokens or self.registration.kv_capacity_tokens or 0,
            num_running=load.num_running, num_waiting=load.num_waiting,
            prefix_cache_hit_rate=min(max(load.prefix_cache_hit_rate, 0.0), 1.0),
            prefill_tokens_per_s=load.prefill_tokens_per_s or None, decode_step_s=load.decode_step_s or None,
            max_num_batched_tokens=load.max_num_batched_tokens or None,
            prompt_tokens_total=load.prompt_tokens_total, generation_tokens_total=load.generation_tokens_total,
            preemptions_total=load.preemptions_total,
            seq=self._seq, sent_at=time.time(), boot_id=self.registration.boot_id, kv_events=batch,
        )
        resync = batch is not None  # until the proxy's answer shows it took the batch
        try:
            async with self._session.post(f"{self.proxy_url}/workers/{self.worker_id}/report",
                                          data=report.model_dump_json(exclude_none=True),
                                          headers={"Content-Type": "application/json", **self._own_headers()},
                                          timeout=REPORT_TIMEOUT) as resp:
                if resp.status in (401, 404):  # 401: the proxy knows no worker by this secret (it forgot this one)
                    return False
                if resp.status >= 400:
                    log.warning("report rejected (%s): %s", resp.status, (await resp.text())[:200])
                elif resp.content_type == "application/json":
                    body = await resp.json()
                    self._adopt_interval(body)
                    resync = isinstance(body, dict) and bool(body.get("kv_resync"))
        finally:
            if resync and self.kv_events is not None:
                self.kv_events.resync()  # lost, refused, or the proxy's view is stale: everything next time
        return True

    def _adopt_interval(self, body: object) -> None:
        """Report as often as the proxy's answer asks (never slower than max_interval_s, never above 100 Hz)."""
        asked = body.get("report_interval_s") if isinstance(body, dict) else None
        if isinstance(asked, int | float) and asked > 0:
            self.interval_s = min(self.max_interval_s, max(MIN_INTERVAL_S, float(asked)))

    def _own_headers(self) -> dict[str, str]:
        """Credentials for acting on this worker: its own secret; a proxy without secrets gets the token."""
        return {"Authorization": f"Bearer {self._secret}"} if self._secret else dict(self._register_headers)

    async def _run(self) -> None:
        await self._register()
        unreachable = 0
        while True:
            started = time.monotonic()
            try:
                if not await self._send_report():
                    log.warning("proxy no longer knows %s; registering again", self.worker_id)
                    self.registered.clear()
                    await self._register()
                unreachable = 0
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.debug("report failed: %s", exc)
                unreachable += 1
                if unreachable >= FAILOVER_AFTER_FAILURES and len(self.proxy_urls) > 1:
                    # The proxy died or is cut off: the others share its view (state: redis), so the
                    # worker registers with the next one and keeps serving instead of going stale.
                    failed = self.proxy_url
                    self._next_proxy()
                    log.warning("proxy %s unreachable for %d reports; moving to %s", failed, unreachable,
                                self.proxy_url)
                    unreachable = 0
                    self.registered.clear()
                    await self._register()
            except Exception:  # a broken load source must not stop the reports for good
                log.exception("load source failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def set_state(self, state: str) -> None:
        """Change the reported state (e.g. 'draining') and tell the proxy at once."""
        self.state = state
        if self.worker_id and self._session and self.registered.is_set():
            try:
                await self._send_report()
            except (aiohttp.ClientError, TimeoutError):
                pass

    async def stop(self, deregister: bool = True) -> None:
        if self._after_register is not None:
            self._after_register.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if deregister and self._session and self.worker_id and self.registered.is_set():
            try:
                async with self._session.delete(f"{self.proxy_url}/workers/{self.worker_id}",
                                                headers=self._own_headers()) as resp:
                    log.info("deregistered %s (%s)", self.worker_id, resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.info("could not deregister: %s", exc)
        if self._session:
            await self._session.close()
