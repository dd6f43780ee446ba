"""The worker's subscription to its engine's KV-cache events (vLLM's ZMQ publisher, or the sim's in its format).

Owns the ZMQ side on the engine's host: where the engine publishes (private ipc:// sockets, which the engine
binds and which never leave the host), the SUB socket, decoding vLLM's messages (multipart: topic, 8-byte
big-endian sequence number, msgpack EventBatch), and sequence checks: a skipped number is fetched again from
the publisher's replay socket, and what cannot be replayed is declared lost. It feeds a KvMirror
(backends/kv_mirror.py); it sends nothing to the proxy.

ipc:// rather than tcp://127.0.0.1: vLLM connects (not binds) a concrete tcp host, so the subscriber would have
to bind, and a bound SUB socket never received from a connecting PUB with the libzmq here (4.3.5, pyzmq 27:
docs/design/kv-events.md); a wildcard tcp endpoint, which vLLM binds, would listen beyond the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from backends.kv_mirror import KvMirror
from proxy.routing.block_hash import event_hash

log = logging.getLogger("kvroute.kv_subscriber")

TOPIC = "kv-events"
# Messages held unread at the socket before libzmq drops them (each is one engine step's events); a drop is a
# sequence gap, fetched again from the replay socket (vLLM keeps its last 10000 batches).
RECEIVE_HWM = 4096
REPLAY_TIMEOUT_S = 2.0
# With nothing received for this long, the subscriber asks the replay socket for anything it missed.
IDLE_PROBE_S = 1.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Blocks on other tiers (vLLM's KV offloading: "CPU", "STORAGE") are not in the engine's prefix cache.
CACHE_MEDIA = (None, "GPU")


@dataclass(frozen=True)
class EventEndpoints:
    """Where one engine publishes its events and serves replays."""

    events: str
    replay: str | None = None
    topic: str = TOPIC
    directory: str | None = None  # the private folder of ipc sockets, removed by close()

    def vllm_config(self) -> dict[str, Any]:
        """vLLM's --kv-events-config for these endpoints (the sim takes the same JSON)."""
        config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events,
                                  "topic": self.topic}
        if self.replay:
            config["replay_endpoint"] = self.replay
        return config

    def close(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def local_endpoints() -> EventEndpoints:
    """ipc:// endpoints in a new folder only this user can enter (0700): nothing else on the host reads them."""
    directory = tempfile.mkdtemp(prefix="kvroute-kv-")
    os.chmod(directory, 0o700)
    return EventEndpoints(f"ipc://{directory}/events", f"ipc://{directory}/replay", TOPIC, directory)


# vLLM's events (vllm/distributed/kv_events.py), reduced to the fields routing needs: msgspec skips the rest
# (token ids included) without building them.
class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    block_size: int = 0
    medium: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)


def _ints(hashes: list[int | bytes]) -> list[int]:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 publishes the digests themselves; routing names blocks by 64 bits
    return [h if isinstance(h, int) else event_hash(h) for h in hashes]


def apply_payload(mirror: KvMirror, payload: bytes) -> None:
    """Apply one published EventBatch to `mirror`; ValueError when it cannot be read."""
    try:
        batch = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    for event in batch.events:
        if isinstance(event, _Stored):
            if event.medium in CACHE_MEDIA:
                size = event.block_size if event.block_size and len(event.block_hashes) else None
                mirror.stored(_ints(event.block_hashes), size)
        elif isinstance(event, _Removed):
            if event.medium in CACHE_MEDIA:
                mirror.removed(_ints(event.block_hashes))
        else:
            mirror.cleared()


class KvSubscriber:
    """Keeps `mirror` equal to what the engine publishing at `endpoints` holds; start() before the engine runs."""

    def __init__(self, endpoints: EventEndpoints, mirror: KvMirror) -> None:
        self.endpoints = endpoints
        self.mirror = mirror
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._expected = 0  # the next sequence number due (the subscriber runs before the engine publishes)
        self.received = 0

    async def start(self) -> None:
        sub = self._sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.subscribe(self.endpoints.topic.encode())
        sub.connect(self.endpoints.events)  # libzmq retries until the engine binds it
        self._task = asyncio.create_task(self._run(), name="kvroute-kv-subscriber")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            self._sub.close(0)
        self._ctx.term()

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            if not await self._sub.poll(IDLE_PROBE_S * 1000):
                # PUB/SUB cannot tell a subscriber what it missed until the next batch: batches published before
                # the subscription reached the publisher, or the last ones before a quiet spell, would wait for
                # the next change. Asking the replay socket while idle brings them in.
                await self._catch_up()
                continue
            frames = await self._sub.recv_multipart()
            if len(frames) == 3:
                await self.receive(int.from_bytes(frames[1], "big"), frames[2])

    async def _catch_up(self) -> None:
        if self.endpoints.replay is None:
            return
        for seq, payload in await self._replay(self._expected, quiet=True):  # quiet: the engine may be starting
            if seq == self._expected:
                self._apply(seq, payload)

    async def receive(self, seq: int, payload: bytes) -> None:
        """One published batch, in the order the socket delivered it."""
        if seq < self._expected:
            if seq != 0:
                return  # applied already (replayed, then received live)
            log.info("the engine's KV events restarted at 0: so did its engine, with an empty cache")
            self.mirror.cleared()
            self._expected = 0
        elif seq > self._expected:
            await self._recover(seq)
        if seq == self._expected:
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            apply_payload(self.mirror, payload)
        except ValueError as exc:
            log.warning("unreadable KV event batch %d (%s): the view of the engine's cache is incomplete", seq, exc)
            self.mirror.lost()
        self.received += 1
        self._expected = seq + 1

    async def _recover(self, seq: int) -> None:
        """Batches before `seq` were skipped: fetch them from the replay socket; what it no longer has is lost."""
        start = self._expected
        for replayed_seq, payload in await self._replay(start) if self.endpoints.replay else []:
            if replayed_seq == self._expected:
                self._apply(replayed_seq, payload)
        if self._expected < seq:
            log.warning("KV event batches %d..%d are lost (not replayable): the view of the engine's cache is "
                        "incomplete until it clears it", start, seq - 1)
            self.mirror.lost()
            self._expected = seq

    async def _replay(self, start: int, quiet: bool = False) -> list[tuple[int, bytes]]:
        assert self.endpoints.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoints.replay)
        batches: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or frames[2] == END_SEQ:
                        return batches
                    batches.append((int.from_bytes(frames[2], "big"), frames[3]))
        except TimeoutError:
            if not quiet:
                log.warning("no replay from the engine's KV event publisher within %.0fs", REPLAY_TIMEOUT_S)
            return batches
        finally:
            dealer.close(0)


class EngineKvFeed:
    """What a worker runs to forward its engine's KV events: private endpoints, the copy of the engine's
    cache (`mirror`, which the reporter takes batches from) and the subscription that keeps it."""

    def __init__(self, hash_algo: str, hash_seed: str, block_size: int | None = None,
                 capacity_blocks: int | None = None) -> None:
        self.endpoints = local_endpoints()
        self.mirror = KvMirror(hash_algo, hash_seed, block_size, capacity_blocks)
        self.subscriber = KvSubscriber(self.endpoints, self.mirror)

    def capacity_from(self, capacity_tokens: int | None, block_size: int | None = None) -> None:
        """The engine's KV capacity and block size as its load says (bounds the mirror, tells the proxy its size;
        the block size lets the proxy hash prompts before the engine's first stored block names it)."""
        mirror = self.mirror
        if block_size:
            mirror.learn_block_size(block_size)
        if capacity_tokens and mirror.block_size:
            mirror.capacity_blocks = max(1, capacity_tokens // mirror.block_size)

    def engine_config(self) -> dict[str, Any]:
        """The --kv-events-config the engine publishes with."""
        return self.endpoints.vllm_config()

    async def start(self) -> None:
        await self.subscriber.start()

    async def stop(self) -> None:
        await self.subscriber.stop()
        self.endpoints.close()
