"""KV hand-over between sim workers of a disaggregated fleet, in vLLM's NIXL protocol (pull mode).

Owns both ends. The prefill side (`KvHolder`) keeps a finished `do_remote_decode` request's blocks, answers
with the `kv_transfer_params` vLLM's NixlConnector gives, and frees the blocks once a decode worker pulled them
or their lease ran out. The decode side (`KvPuller`) pulls a parked request's blocks over HTTP from the prefill
sim the params name (`POST /sim/kv/pull`, the sim's stand-in for NIXL's side channel and RDMA read), sends
lease heartbeats while the request waits for room, and tells the prefill side to free the blocks of a request
it drops. It does not schedule (scheduler.py parks and resumes) nor serve the OpenAI routes (server.py).

Transfer time (simulated seconds; proxy/pools.py's links, docs/design/sim.md):

    bytes = blocks pulled x block_size x kv_bytes_per_token    (2 x layers x kv_heads x head_dim x 2 bytes)
    time  = link latency + bytes / link bandwidth                (the slower link of the two workers)

Each worker's NIC moves one transfer at a time: a pull waits for the decode side's link, then the prefill
side's. Lease (vLLM 0.32's NIXL `kv_lease_duration`, 30 s): a held request nobody pulls is freed that long
after it finished; a decode worker still holding the request in its queue renews it every lease / 6.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from backends.sim.engine import SimEngine
from backends.sim.scheduler import RequestStatus, SimRequest
from proxy.pools import Link, link

log = logging.getLogger("kvroute.sim.transfer")

DEFAULT_LEASE_S = 30.0  # vLLM's kv_lease_duration default (NIXL connector, 0.32)
PULL_TIMEOUT_S = 120.0  # wall seconds one pull may take, queueing for both links included
_REMOTE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def transfer_seconds(num_bytes: float, over: Link) -> float:
    return over.latency_s + num_bytes / over.bytes_per_s


def wants_remote_prefill(params: Any) -> bool:
    """A decode request: the params of a prefill answer (NIXL's check: do_remote_prefill and every remote_*)."""
    return isinstance(params, dict) and bool(params.get("do_remote_prefill")) and all(k in params for k in _REMOTE_KEYS)


def wants_remote_decode(params: Any) -> bool:
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


@dataclass
class _Held:
    num_blocks: int
    expires_at: float  # simulated seconds
    pulling: bool = False


@dataclass
class TransferCounters:
    """What /sim/state and /metrics show of the hand-over (one worker's view: it may play both ends)."""

    transfers_sent: int = 0
    bytes_sent: int = 0
    transfers_received: int = 0
    bytes_received: int = 0
    transfer_seconds_received: float = 0.0
    lease_timeouts: int = 0  # held requests freed unpulled (vLLM's nixl_num_kv_expired_reqs)
    failed_pulls: int = 0  # pulls that found nothing or could not reach the prefill worker


class KvHolder:
    """Prefill side: blocks held for transfer, their leases, and the pull and heartbeat routes."""

    def __init__(self, engine: SimEngine, link_name: str, counters: TransferCounters,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.engine = engine
        self.link = link(link_name)
        self.lease_s = lease_s
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.endpoint: tuple[str, int] | None = None  # host and port decode workers pull from (set once listening)
        self.counters = counters
        self._held: dict[str, _Held] = {}
        self._out_link = asyncio.Lock()
        engine.finish_listeners.append(self._on_finished)

    @property
    def blocks_held(self) -> int:
        return sum(h.num_blocks for h in self._held.values())

    @property
    def requests_held(self) -> int:
        return len(self._held)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/sim/kv/pull", self.handle_pull)
        app.router.add_post("/sim/kv/heartbeat", self.handle_heartbeat)

    def _on_finished(self, request: SimRequest) -> None:
        if not request.hold_kv or request.failed:
            return
        blocks = self.engine.kv.blocks_of(request.request_id)
        if not blocks:
            return
        self._held[request.request_id] = _Held(len(blocks), self.engine.now() + self.lease_s)
        self._arm(request.request_id)

    def params(self, request: SimRequest) -> dict[str, Any] | None:
        """The prefill answer's kv_transfer_params, shaped as vLLM's NixlConnector.request_finished returns them."""
        if request.request_id not in self._held or self.endpoint is None:
            return None
        host, port = self.endpoint
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[b.block_id for b in self.engine.kv.blocks_of(request.request_id)]],
                "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                "remote_host": host, "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": request.num_computed_tokens, "remote_blocks_expiry_time": None,
                "transfer_mode": "pull", "remote_prefill_cached_tokens": request.num_cached_tokens}

    # ---- leases -------------------------------------------------------------------------------
    def _arm(self, request_id: str) -> None:
        held = self._held[request_id]
        delay = max(held.expires_at - self.engine.now(), 0.0) / self.engine.time_scale
        asyncio.get_running_loop().call_later(delay, self._expire, request_id)

    def _expire(self, request_id: str) -> None:
        held = self._held.get(request_id)
        if held is None or held.pulling:
            return
        if held.expires_at > self.engine.now():  # renewed by a heartbeat since: wait for the new deadline
            self._arm(request_id)
            return
        del self._held[request_id]
        self.counters.lease_timeouts += 1
        log.warning("releasing the KV blocks of %s: no decode worker pulled them within the %gs lease",
                    request_id, self.lease_s)
        self.engine.release_blocks(request_id)

    async def handle_heartbeat(self, request: web.Request) -> web.Response:
        try:
            ids = orjson.loads(await request.read())["request_ids"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return web.json_response({"error": "body must be {\"request_ids\": [...]}"}, status=400)
        renewed = 0
        for request_id in ids if isinstance(ids, list) else []:
            held = self._held.get(request_id) if isinstance(request_id, str) else None
            if held is not None:
                held.expires_at = max(held.expires_at, self.engine.now() + self.lease_s)
                renewed += 1
        return web.json_response({"renewed": renewed})

    # ---- the pull ----------------------------------------------------------------------------
    async def handle_pull(self, request: web.Request) -> web.Response:
        """Body {remote_request_id, block_ids, link}: send those blocks (none: just free them), then free all."""
        try:
            body = orjson.loads(await request.read())
            request_id, block_ids = str(body["remote_request_id"]), list(body.get("block_ids") or [])
            their_link = link(str(body.get("link") or self.link.name))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": f"bad pull: {exc}"}, status=400)
        held = self._held.get(request_id)
        if held is None or held.pulling:
            return web.json_response({"error": f"no KV held for {request_id} (lease over, or pulled)"}, status=404)
        held.pulling = True
        try:
            num_blocks = min(len(block_ids), held.num_blocks)
            num_bytes = int(num_blocks * self.engine.kv.block_size * self.engine.preset.kv_bytes_per_token)
            slower = min(self.link, their_link, key=lambda lk: lk.bytes_per_s)
            seconds = transfer_seconds(num_bytes, slower) if num_blocks else 0.0
            if num_blocks:
                async with self._out_link:
                    await asyncio.sleep(seconds / self.engine.time_scale)
                self.counters.transfers_sent += 1
                self.counters.bytes_sent += num_bytes
        finally:  # sent, or the puller went away mid-transfer: either way the blocks are done with
            del self._held[request_id]
            self.engine.release_blocks(request_id)
        return web.json_response({"blocks": num_blocks, "bytes": num_bytes, "seconds": seconds})


class KvPuller:
    """Decode side: pulls a parked request's KV, keeps leases alive while requests queue, releases dropped ones."""

    def __init__(self, engine: SimEngine, link_name: str, counters: TransferCounters,
                 recompute_on_failure: bool = False, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.engine = engine
        self.link = link(link_name)
        self.counters = counters
        self.recompute_on_failure = recompute_on_failure  # vLLM's kv_load_failure_policy: "fail" by default
        self.lease_s = lease_s
        self._in_link = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._queued: dict[str, SimRequest] = {}  # remote-prefill requests still in the queue: heartbeat them
        self._heartbeats: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        engine.remote_kv = self

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S, connect=5))
        return self._session

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def track(self, request: SimRequest) -> None:
        """A remote-prefill request entered the queue: keep its prefill worker's lease alive until it parks."""
        self._queued[request.request_id] = request
        if self._heartbeats is None or self._heartbeats.done():
            self._heartbeats = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    # ---- RemoteKvHooks ------------------------------------------------------------------------
    def parked(self, request: SimRequest) -> None:
        self._queued.pop(request.request_id, None)
        self._spawn(self._pull(request, dict(request.remote_kv or {})))

    def abandoned(self, request: SimRequest) -> None:
        self._queued.pop(request.request_id, None)
        params = dict(request.remote_kv or {})
        request.remote_kv = None
        self.release(params)

    def release(self, params: dict[str, Any]) -> None:
        """Tell the prefill worker `params` name to free those blocks now (vLLM: an empty read notification)."""
        self._spawn(self._post(params, "/sim/kv/pull", {"remote_request_id": params.get("remote_request_id"),
                                                        "block_ids": [], "link": self.link.name}))

    # ---- the exchange ------------------------------------------------------------------------
    @staticmethod
    def _url(params: dict[str, Any], path: str) -> str:
        return f"http://{params['remote_host']}:{int(params['remote_port'])}{path}"

    async def _post(self, params: dict[str, Any], path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            async with self._client().post(self._url(params, path), data=orjson.dumps(body),
                                           headers={"Content-Type": "application/json"}) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:  # TypeError: odd params
            log.warning("KV exchange with %s:%s failed: %s", params.get("remote_host"), params.get("remote_port"), exc)
            return None

    async def _pull(self, request: SimRequest, params: dict[str, Any]) -> None:
        """Pull the blocks the local prefix cache does not already hold; then the request joins the batch."""
        block_size = self.engine.kv.block_size
        groups = params.get("remote_block_ids")
        remote_blocks = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], list) else []
        wanted = remote_blocks[request.num_computed_tokens // block_size:]
        if not remote_blocks:  # nothing to pull (vLLM: no remote blocks, no transfer): compute it here
            self.engine.kv_arrived(request, None, recompute=True)
            return
        started = self.engine.now()
        async with self._in_link:
            answer = await self._post(params, "/sim/kv/pull", {"remote_request_id": params["remote_request_id"],
                                                              "block_ids": wanted, "link": self.link.name})
        if answer is None:
            self.counters.failed_pulls += 1
            self.engine.kv_arrived(request, None, recompute=self.recompute_on_failure)
            return
        self.counters.transfers_received += 1
        self.counters.bytes_received += int(answer.get("bytes", 0))
        self.counters.transfer_seconds_received += self.engine.now() - started
        remote_tokens = params.get("remote_num_tokens")
        remote_tokens = remote_tokens if isinstance(remote_tokens, int) else request.num_prompt_tokens
        loaded = max(min(remote_tokens, request.num_prompt_tokens) - request.num_computed_tokens, 0)
        self.engine.kv_arrived(request, loaded)

    async def _heartbeat_loop(self) -> None:
        """Every lease / 6 (as vLLM's NIXL scheduler), renew the leases of the requests still queued here."""
        while self._queued:
            await asyncio.sleep(self.lease_s / 6 / self.engine.time_scale)
            by_endpoint: dict[tuple[str, int], tuple[dict[str, Any], list[str]]] = {}
            for request in list(self._queued.values()):
                params = request.remote_kv
                if params is None or request.status is not RequestStatus.WAITING:
                    self._queued.pop(request.request_id, None)
                    continue
                try:
                    key = (str(params["remote_host"]), int(params["remote_port"]))
                except (KeyError, TypeError, ValueError):
                    self._queued.pop(request.request_id, None)  # its pull will fail and say so
                    continue
                by_endpoint.setdefault(key, (params, []))[1].append(str(params["remote_request_id"]))
            for params, ids in by_endpoint.values():
                with contextlib.suppress(Exception):
                    await self._post(params, "/sim/kv/heartbeat", {"request_ids": ids})
