"""The sim's KV-cache events, published as vLLM publishes them: ZMQ, msgpack, one batch per engine step.

Owns turning the sim's prefix-cache changes (kvcache.py's CacheListener) into vLLM's events (BlockStored with
the blocks' vLLM hashes, parent, token ids and extra keys; BlockRemoved; AllBlocksCleared), and the
publisher: a PUB socket sending (topic, 8-byte big-endian sequence number, EventBatch) and a ROUTER socket
that replays recent batches, at the endpoints of vLLM's --kv-events-config with vLLM's rule (a wildcard
host or an ipc://, inproc:// endpoint is bound, any other connected). So kvroute's worker and vllm-router's
KV-event policy subscribe to a sim as to vLLM.

Block hashes are vLLM's (proxy/routing/block_hash.py, sha256_cbor and vLLM's default seed) over the token ids
a client sees from /tokenize (an image's placeholders as <|image_pad|>) with each image's identifier as an
extra key, so a proxy recomputes them from those token ids. The sim's own cache keys stay its cheaper ones;
this module maps each cached block to its vLLM hash while it is cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from backends.kv_mirror import KvMirror
from backends.kv_subscriber import EngineKvFeed
from backends.sim.engine import SimEngine
from backends.sim.scheduler import SimRequest
from backends.sim.tokens import public_token_ids
from proxy.routing.block_hash import DEFAULT_ALGO, DEFAULT_SEED, HashScheme, block_digests, event_hash

log = logging.getLogger("kvroute.sim.kv_publisher")

BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)
PUB_HWM = 100_000
# per-request hash chains kept while requests run (a finished request's entry is dropped at its next miss)
MAX_TRACKED_REQUESTS = 4096
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# Fields and defaults as vllm/distributed/kv_events.py has them: lora_id, medium and lora_name have no default,
# so they are always on the wire (vllm-router's decoder refuses a BlockStored without them); group_idx is sent.
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = 0


def binds(endpoint: str) -> bool:
    """vLLM's rule (ZmqEventPublisher._is_bind_endpoint): wildcards and local transports are bound."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class _Chain:
    """One request's blocks as vLLM names them: its token ids as /tokenize shows them and the blocks' full
    digests (for chaining), both extended as the request's blocks are cached."""

    __slots__ = ("request", "public", "digests")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.public: list[int] = []
        self.digests: list[bytes] = []


class SimKvPublisher:
    """Publishes `engine`'s cache changes; `configs` are vLLM --kv-events-config dicts (one socket set each)."""

    def __init__(self, engine: SimEngine, configs: Sequence[dict[str, Any]],
                 scheme: HashScheme | None = None) -> None:
        self.engine = engine
        self.scheme = scheme or HashScheme(engine.kv.block_size, DEFAULT_ALGO, DEFAULT_SEED)
        self._ctx = zmq.asyncio.Context()
        self._pubs: list[tuple[zmq.asyncio.Socket, bytes]] = []
        self._replays: list[tuple[zmq.asyncio.Socket, bytes]] = []
        for config in configs:
            topic = str(config.get("topic", "")).encode()
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, int(config.get("hwm", PUB_HWM)))
            pub.setsockopt(zmq.LINGER, 0)
            endpoint = str(config.get("endpoint", "tcp://*:5557"))
            pub.bind(endpoint) if binds(endpoint) else pub.connect(endpoint)
            self._pubs.append((pub, topic))
            if config.get("replay_endpoint"):
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(str(config["replay_endpoint"]))
                self._replays.append((router, topic))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._seq = 0
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._event_of: dict[int, int] = {}  # the sim's key of a cached block -> its vLLM event hash
        self._chains: OrderedDict[str, _Chain] = OrderedDict()
        self._running_at = -1  # engine step of the running-request index below
        self._running: dict[str, SimRequest] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks = [asyncio.create_task(self._serve_replays(router, topic), name="kvroute-sim-kv-replay")
                       for router, topic in self._replays]
        engine.kv.listener = self
        engine.step_listeners.append(self.flush)
        engine.finish_listeners.append(self._finished)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock, _ in self._pubs + self._replays:
            sock.close(0)
        self._ctx.term()

    # --- kvcache.CacheListener ------------------------------------------------------------------
    def cached(self, request_id: str, index: int, block_hash: int) -> None:
        chain = self._chain(request_id)
        if chain is None:
            return  # not a running request (cannot happen: kvcache caches blocks of running requests)
        digests = self._extend(chain, index + 1)
        if len(digests) <= index:
            return
        event = event_hash(digests[index])
        self._event_of[block_hash] = event
        size = self.scheme.block_size
        tokens = chain.public[index * size:(index + 1) * size]
        extra = self._extra_keys(chain.request, index)
        parent = event_hash(digests[index - 1]) if index else None
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and last.block_hashes and index and parent == last.block_hashes[-1]:
            last.block_hashes.append(event)  # the next block of the same run: one event, as vLLM sends it
            last.token_ids.extend(tokens)
            if last.extra_keys is not None or extra is not None:
                last.extra_keys = (last.extra_keys or [None] * (len(last.block_hashes) - 1)) + [extra]
            return
        self._pending.append(BlockStored([event], parent, tokens, size, None, "GPU", None,
                                          extra_keys=[extra] if extra else None, group_idx=0))

    def evicted(self, block_hash: int) -> None:
        event = self._event_of.pop(block_hash, None)
        if event is not None:
            self._pending.append(BlockRemoved([event], "GPU", group_idx=0))

    def reset(self) -> None:
        self._event_of.clear()
        self._pending.append(AllBlocksCleared())

    # --- hashing --------------------------------------------------------------------------------
    def _chain(self, request_id: str) -> _Chain | None:
        chain = self._chains.get(request_id)
        if chain is not None:
            return chain
        if self._running_at != self.engine.num_steps:
            self._running = {r.request_id: r for r in self.engine.scheduler.running}
            self._running_at = self.engine.num_steps
        request = self._running.get(request_id)
        if request is None:
            return None
        chain = self._chains[request_id] = _Chain(request)
        if len(self._chains) > MAX_TRACKED_REQUESTS:
            self._chains.popitem(last=False)
        return chain

    def _extend(self, chain: _Chain, blocks: int) -> list[bytes]:
        if len(chain.digests) < blocks:
            # every block the request has computed: kvcache caches a step's new blocks one call each
            request, size = chain.request, self.scheme.block_size
            blocks = max(blocks, request.num_computed_tokens // size)
            public = chain.public
            if len(public) < blocks * size:
                public.extend(public_token_ids(request.token_ids[len(public):blocks * size]))
            block_digests(self.scheme, public, self._media(request), max_blocks=blocks, known=chain.digests)
        return chain.digests

    @staticmethod
    def _media(request: SimRequest) -> list[tuple[str, int, int]]:
        prompt = request.prompt
        return [(name, start, length) for (start, length), name in zip(prompt.media_spans, prompt.media_ids,
                                                                        strict=False)]

    def _extra_keys(self, request: SimRequest, index: int) -> tuple[Any, ...] | None:
        """The block's extra keys as vLLM's events carry them (untagged: (identifier, offset) per item)."""
        size = self.scheme.block_size
        start, end = index * size, (index + 1) * size
        keys = [(name, offset - start) for name, offset, length in self._media(request)
                if offset < end and offset + length > start]
        return tuple(keys) if keys else None

    def _finished(self, request: SimRequest) -> None:
        self._chains.pop(request.request_id, None)

    # --- publishing -----------------------------------------------------------------------------
    def flush(self) -> None:
        """After each engine step: the step's events as one batch (nothing when nothing changed)."""
        if not self._pending:
            return
        payload = self._encoder.encode(EventBatch(time.time(), self._pending))
        self._pending = []
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        seq_bytes = seq.to_bytes(8, "big")
        for pub, topic in self._pubs:
            with contextlib.suppress(zmq.Again):  # a subscriber that does not keep up misses it (a gap)
                pub.send_multipart((topic, seq_bytes, payload), flags=zmq.NOBLOCK)

    async def _serve_replays(self, router: zmq.asyncio.Socket, topic: bytes) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", b"", END_SEQ, b""))


class SimKvEvents:
    """A sim worker's KV events end to end: the publisher, and, when it forwards them to a proxy, the same
    subscription a vLLM worker runs (backends/kv_subscriber.py) on a private endpoint of the publisher."""

    def __init__(self, engine: SimEngine, forward: bool, configs: Sequence[dict[str, Any]] = ()) -> None:
        self.engine = engine
        self.advertised = list(configs)  # what GET /kv_event_sources shows (not the worker's private socket)
        self.configs = list(configs)
        self.feed: EngineKvFeed | None = None
        if forward:
            kv = engine.kv
            self.feed = EngineKvFeed(DEFAULT_ALGO, DEFAULT_SEED, kv.block_size, kv.num_blocks)
            self.configs.append(self.feed.engine_config())
        self.publisher: SimKvPublisher | None = None

    @property
    def mirror(self) -> KvMirror | None:
        return self.feed.mirror if self.feed is not None else None

    async def start(self) -> None:
        if self.feed is not None:
            await self.feed.start()
        if self.configs:
            self.publisher = SimKvPublisher(self.engine, self.configs)

    def flush(self) -> None:
        """Publish changes made outside an engine step (a cache reset) now."""
        if self.publisher is not None:
            self.publisher.flush()

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self.feed is not None:
            await self.feed.stop()


def add_kv_event_routes(app: web.Application, engine: SimEngine, events: Callable[[], SimKvEvents | None]) -> None:
    """vLLM's two routes about the prefix cache: where the KV events are published, per data-parallel rank
    (GET /kv_event_sources), and dropping the cache's unheld blocks (POST /reset_prefix_cache, vLLM's dev mode:
    AllBlocksCleared when none stay)."""

    async def sources(_request: web.Request) -> web.Response:
        current = events()
        configs = current.advertised if current is not None else []
        return web.json_response({str(rank): config for rank, config in enumerate(configs[:1])})

    async def reset(_request: web.Request) -> web.Response:
        engine.kv.reset_prefix_cache()
        if (current := events()) is not None:
            current.flush()
        return web.Response(status=200)

    app.router.add_get("/kv_event_sources", sources)
    app.router.add_post("/reset_prefix_cache", reset)


def kv_event_configs(raw: str | None) -> list[dict[str, Any]]:
    """--kv-events-config as a list of publisher configs; ValueError names what is wrong."""
    if not raw:
        return []
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("endpoint", ""), str):
        raise ValueError("--kv-events-config must be a JSON object with a string `endpoint`")
    if config.get("enable_kv_cache_events") is False or config.get("publisher") == "null":
        return []
    return [config]
