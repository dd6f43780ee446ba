"""The encode role of the sim, and encoder output handed from an encode worker to the others.

Owns the encoder cache (media content hash -> its output, LRU by media tokens), the vision tower's time on an
encode worker, the `ec_transfer_params` its answers carry (vLLM 0.32's shape: per media hash its item indices,
metadata and where to fetch it), the `POST /sim/ec/pull` route that hands an output over, and the consumer side
that fetches what a request's `ec_transfer_params` name before the request is scheduled. An encode worker runs
no language model (vLLM's encoder-only instance): its answers have no tokens.

    encode time   = step overhead + max(8 x ViT params x media tokens / (peak x mfu),   (compute)
                                        2 x ViT params / (HBM bandwidth x efficiency))   (weights, once)
    output bytes  = media tokens x hidden x 2 bytes x (1 + DeepStack levels)
    transfer time = link latency + output bytes / link bandwidth      (backends/sim/transfer.py's links)
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from backends.sim.presets import Preset
from backends.sim.tokens import Prompt, media_hash
from proxy.pools import link

log = logging.getLogger("kvroute.sim.encoder")

# Encoder outputs an encode worker keeps, in media tokens (vLLM sizes its encoder cache in embeddings too; an
# encode-only instance has the memory the LLM's KV would take)
ENCODER_CACHE_TOKENS = 262_144
FETCH_TIMEOUT_S = 60.0


def encode_seconds(preset: Preset, media_tokens: int) -> float:
    if media_tokens <= 0:
        return 0.0
    compute = 8.0 * preset.vit_params * media_tokens / (preset.peak_flops * preset.mfu)
    weights = 2.0 * preset.vit_params / (preset.hbm_bandwidth * preset.bw_efficiency)
    return preset.step_overhead_s + max(compute, weights)


@dataclass
class EncoderCounters:
    cache_hits: int = 0  # media items found in the encoder cache
    cache_misses: int = 0
    media_tokens_encoded: int = 0
    outputs_sent: int = 0
    bytes_sent: int = 0
    outputs_received: int = 0
    bytes_received: int = 0
    failed_fetches: int = 0  # named by ec_transfer_params but gone: encoded here instead


class EncoderCache:
    """Media hash -> media tokens of its output, least recently used evicted first."""

    def __init__(self, capacity_tokens: int = ENCODER_CACHE_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self._items: OrderedDict[str, int] = OrderedDict()
        self.tokens = 0

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def touch(self, key: str) -> bool:
        if key not in self._items:
            return False
        self._items.move_to_end(key)
        return True

    def insert(self, key: str, tokens: int) -> None:
        if key in self._items:
            return
        self._items[key] = tokens
        self.tokens += tokens
        while self.tokens > self.capacity_tokens and len(self._items) > 1:
            _, gone = self._items.popitem(last=False)
            self.tokens -= gone

    def tokens_of(self, key: str) -> int | None:
        return self._items.get(key)

    def __len__(self) -> int:
        return len(self._items)


class SimEncoder:
    """An encode worker: one vision tower (requests encode one at a time) and its cache."""

    def __init__(self, preset: Preset, time_scale: float, link_name: str, counters: EncoderCounters) -> None:
        self.preset = preset
        self.time_scale = time_scale
        self.link = link(link_name)
        self.counters = counters
        self.cache = EncoderCache()
        self.endpoint: tuple[str, int] | None = None
        self.busy = 0  # requests encoding or waiting for the tower (reported as running / waiting)
        self._tower = asyncio.Lock()
        self._out_link = asyncio.Lock()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/sim/ec/pull", self.handle_pull)

    async def encode(self, prompt: Prompt) -> dict[str, Any]:
        """Run the vision tower on the media not cached; the answer's ec_transfer_params."""
        todo: dict[str, int] = {}
        items: dict[str, dict[str, Any]] = {}
        for index, ((_, length), key) in enumerate(zip(prompt.media_spans, prompt.media_keys, strict=True)):
            name = media_hash(key)
            entry = items.setdefault(name, {"item_indices": [], "metadata": {}, "num_tokens": length,
                                            "size_bytes": int(length * self.preset.encoder_bytes_per_token)})
            entry["item_indices"].append(index)
            if name not in todo and not self.cache.touch(name):
                todo[name] = length
        self.counters.cache_hits += len(items) - len(todo)
        self.counters.cache_misses += len(todo)
        self.busy += 1
        try:
            if todo:
                async with self._tower:
                    await asyncio.sleep(encode_seconds(self.preset, sum(todo.values())) / self.time_scale)
                for name, tokens in todo.items():
                    self.cache.insert(name, tokens)
                self.counters.media_tokens_encoded += sum(todo.values())
        finally:
            self.busy -= 1
        if self.endpoint is not None:
            for entry in items.values():
                entry["peer_host"], entry["peer_port"] = self.endpoint
        return items

    async def handle_pull(self, request: web.Request) -> web.Response:
        """Body {mm_hash, link}: send that output if still cached (404 otherwise)."""
        try:
            body = orjson.loads(await request.read())
            name, their_link = str(body["mm_hash"]), link(str(body.get("link") or self.link.name))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": f"bad pull: {exc}"}, status=400)
        tokens = self.cache.tokens_of(name)
        if tokens is None:
            return web.json_response({"error": f"no encoder output for {name}"}, status=404)
        self.cache.touch(name)
        num_bytes = int(tokens * self.preset.encoder_bytes_per_token)
        slower = min(self.link, their_link, key=lambda lk: lk.bytes_per_s)
        async with self._out_link:
            await asyncio.sleep((slower.latency_s + num_bytes / slower.bytes_per_s) / self.time_scale)
        self.counters.outputs_sent += 1
        self.counters.bytes_sent += num_bytes
        return web.json_response({"bytes": num_bytes})


class EncoderOutputs:
    """The consumer side: fetch what a request's ec_transfer_params name, so its prefill skips the vision tower."""

    def __init__(self, link_name: str, time_scale: float, counters: EncoderCounters) -> None:
        self.link = link(link_name)
        self.time_scale = time_scale
        self.counters = counters
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def fetch(self, prompt: Prompt, params: Any) -> frozenset[int]:
        """Indices of the prompt's media spans whose encoder output arrived (the others are encoded here)."""
        if not isinstance(params, dict) or not prompt.media_keys:
            return frozenset()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S, connect=5))
        done: set[int] = set()
        for index, key in enumerate(prompt.media_keys):
            name = media_hash(key)
            entry = params.get(name)
            if not isinstance(entry, dict) or "peer_host" not in entry:
                continue
            if any(prompt.media_keys[i] == key for i in done):
                done.add(index)  # the same image twice: fetched once
                continue
            url = f"http://{entry['peer_host']}:{int(entry['peer_port'])}/sim/ec/pull"
            try:
                async with self._session.post(url, data=orjson.dumps({"mm_hash": name, "link": self.link.name}),
                                              headers={"Content-Type": "application/json"}) as resp:
                    answer = await resp.json() if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning("encoder output %s from %s: %s", name, url, exc)
                answer = None
            if answer is None:
                self.counters.failed_fetches += 1
                continue
            self.counters.outputs_received += 1
            self.counters.bytes_received += int(answer.get("bytes", 0))
            done.add(index)
        return frozenset(done)
