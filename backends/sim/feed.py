"""The sim's state feed, `GET /sim/feed` (bench only, not part of vLLM's API): the engine's true state pushed at
every engine step, for bench/oracle.py.

Owns the feed's wire format and its subscribers. A subscriber first gets the whole prefix cache, then one line
per engine step (newline-delimited JSON; steps the subscriber has not read yet are coalesced into one write):
  {"added": [hash, ...], "removed": [hash, ...], "enqueued": N, "queues": {...}}
- added / removed: full-block hashes that entered or left the prefix cache since the last line (each hash's
  last change only, so the two lists are disjoint). The first line has "reset": true, the model and preset,
  and the whole cache in "added".
- enqueued: requests that reached the scheduler so far (past the simulated API front end).
- queues: the waiting requests ([uncached prompt tokens, tokens left to generate]), the running ones ([prefill
  tokens left, tokens left to generate, blocks held, tokens]), free blocks and the scheduler's limits.
Between steps nothing in the engine changes but arrivals and aborts, so a mirror fed by this is at most one
step behind. Nobody subscribing costs the engine one `is None` check per cached block.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from backends.sim.engine import SimEngine

WAITING_HIT_SAMPLE = 32  # waiting requests whose cached prefix is looked up; the rest get their mean hit fraction


def queue_state(engine: SimEngine) -> dict[str, Any]:
    """The queues and free blocks, as the oracle's predictions read them."""
    sched, kv = engine.scheduler, engine.kv
    waiting, hit_frac = [], []
    for i, r in enumerate(sched.waiting):
        if i < WAITING_HIT_SAMPLE:
            hit = len(kv.find_cached_prefix(r.token_ids, r.full_block_hashes(kv.block_size))) * kv.block_size
            hit_frac.append(hit / max(1, r.num_tokens))
        else:
            hit = int(r.num_tokens * sum(hit_frac) / len(hit_frac))
        waiting.append([r.num_tokens - hit, r.max_tokens - r.num_output_tokens])
    running = [[r.num_tokens - r.num_computed_tokens, r.max_tokens - r.num_output_tokens,
                len(kv.blocks_of(r.request_id)), r.num_tokens] for r in sched.running]
    return {"block_size": kv.block_size, "num_blocks": kv.num_blocks, "free_blocks": kv.num_free_blocks,
            "free_empty_blocks": kv.num_free_blocks - kv.num_free_cached_blocks(),
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "waiting": waiting, "running": running}


class _Subscriber:
    __slots__ = ("pending", "ready")

    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self.ready = asyncio.Event()

    def push(self, line: bytes) -> None:
        self.pending.append(line)
        self.ready.set()


class StateFeed:
    """Subscribers of one engine's feed; the engine's journal of cache changes is kept only while there are any."""

    def __init__(self, engine: SimEngine, model: str, preset_name: str) -> None:
        self.engine = engine
        self.model = model
        self.preset_name = preset_name
        self._subscribers: set[_Subscriber] = set()
        engine.step_listeners.append(self._on_step)

    def _line(self, added: list[int], removed: list[int], reset: bool = False) -> bytes:
        head = {"added": added, "removed": removed, "enqueued": self.engine.num_enqueued}
        if reset:
            head.update(reset=True, model=self.model, preset=self.preset_name)
        return orjson.dumps(head)[:-1] + b',"queues":' + orjson.dumps(queue_state(self.engine)) + b"}\n"

    def _on_step(self) -> None:
        journal = self.engine.kv.journal
        if not self._subscribers or journal is None:
            return
        last = {h: add for add, h in journal}  # added then evicted in one step: gone; evicted then re-added: back
        journal.clear()
        added = [h for h, add in last.items() if add]
        removed = [h for h, add in last.items() if not add]
        line = self._line(added, removed)
        for sub in self._subscribers:
            sub.push(line)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """GET /sim/feed: the snapshot, then a line per engine step until the subscriber leaves."""
        kv = self.engine.kv
        if kv.journal is None:
            kv.journal = []
        sub = _Subscriber()
        # the snapshot already holds the journal's changes; replaying them at the next step changes nothing
        sub.push(self._line(list(kv.cached_hashes()), [], reset=True))
        self._subscribers.add(sub)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            while True:
                await sub.ready.wait()
                sub.ready.clear()
                data = b"".join(sub.pending)
                sub.pending.clear()
                await response.write(data)
        except ConnectionResetError:  # the subscriber left
            pass
        finally:
            self._subscribers.discard(sub)
            if not self._subscribers:
                kv.journal = None
        return response
