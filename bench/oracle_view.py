"""The oracle's copy of each sim worker (bench only): what bench/oracle.py decides on, and its predictions.

Owns the mirror of one worker's feed (`GET /sim/feed`, backends/sim/feed.py: its prefix cache, queues and
free blocks as of its last engine step) plus what only the oracle knows (the requests it sent there, those
the engine has not received yet, the prefixes they compute), and the two ways the oracle scores a worker:
its predicted TTFT (below) and kvroute's own cost function on the true state.

Prediction on worker w (simulated seconds), with R running sequences and a token budget B per step:
- this request's uncached tokens = prompt - the longest prefix that is cached there, or that a request queued
  or running there (or sent there by the oracle and not yet received) is computing: it will be cached first;
- prefill work ahead = uncached prompt tokens of the waiting queue + unfinished prefill of running ones
  + requests this oracle sent to w that its scheduler has not received yet;
- steps = ceil((work ahead + this request's uncached tokens) / max(1, B - R)), each costing one step of
  step_time_s(B - R prefill tokens alongside R decodes) -> queue+prefill time; plus the vision encoder for
  the request's uncached image tokens (8 x ViT params FLOPs each);
- KV wait: if the blocks needed (work ahead and this request) exceed the free blocks, the time until enough
  running sequences finish to free them (their remaining decode tokens x one decode step).
Eviction: blocks allocated beyond the free blocks that hold nothing evict cached prefixes (LRU first);
pricing them at half their prefill time keeps hot prefixes on their owners. Without that term (pure
greedy TTFT) a smoke run in a closed loop on kv_pressure copied every prefix everywhere: engines' hit
rate 51% against 88-90% for kvroute and sglang cache_aware, p50 TTFT 9 s. The oracle is a strong,
fully informed reference, not a proof of optimality.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from backends.sim.cost import StepWork, step_time_s
from backends.sim.kvcache import leading_run
from backends.sim.presets import Preset
from proxy.routing import kv_aware
from proxy.routing_config import KvAwareConfig

KV_AWARE = KvAwareConfig()  # kvroute's default weights (config.yaml's proxy.routing.kv_aware)
PREFIX_BONUS = kv_aware.prefix_bonus_of(KV_AWARE)
EVICT_WEIGHT = 0.5  # seconds of cost per second of prefill that the blocks a request evicts would take to redo


def common_run(a: list[int], b: list[int]) -> int:
    """Length of the common leading run of two hash chains."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class Sent:
    """A request this oracle sent to a worker, until its response ends."""

    uncached_tokens: int
    blocks: int
    hashes: list[int] = field(default_factory=list)  # its full-block hashes (for prefixes being computed there)
    done: bool = False


class WorkerView:
    """One sim worker as the oracle mirrors it from the worker's feed, plus what the oracle sent there."""

    def __init__(self, url: str, stale_s: float = 0.0) -> None:
        self.url = url
        self.stale_s = stale_s  # > 0: decisions see the feed's state as of its last publication, this often
        self._published_at = -math.inf
        self._true_cached: set[int] = set()
        self.model = ""
        self.preset = ""
        self.block_size = 16
        self.cached: set[int] = set()  # the engine's prefix cache (block hashes)
        self.queues: dict[str, Any] = {}  # the feed's latest queue state (backends/sim/feed.py)
        self.enqueued = 0  # requests the engine's scheduler has received (from the feed)
        self.sent = 0  # requests sent here that reach (or reached) its scheduler
        self.recent: deque[Sent] = deque(maxlen=1024)  # the last sends, oldest first
        self.in_flight: dict[int, list[Sent]] = {}  # first block hash -> unfinished sends starting with it
        self.sent_blocks: set[int] = set()  # hashes of every full block sent here (policy kv_aware_owner)
        self.synced = asyncio.Event()  # set once the feed's first line (the whole cache) is applied

    def apply(self, line: dict[str, Any]) -> None:
        """One feed line: cache changes, the scheduler's arrivals and the queues."""
        if line.get("reset"):
            self._true_cached = set(line["added"])
            self.model, self.preset = line["model"], line["preset"]
        else:
            self._true_cached.update(line["added"])
            self._true_cached.difference_update(line["removed"])
        now = time.monotonic()
        if self.stale_s <= 0:
            self.cached = self._true_cached
        elif now - self._published_at >= self.stale_s:  # as a load report would: a copy, this often
            self.cached = set(self._true_cached)
        else:
            return
        self._published_at = now
        self.enqueued = line["enqueued"]
        self.queues = line["queues"]
        self.block_size = self.queues["block_size"]
        self.synced.set()

    def unseen(self) -> list[Sent]:
        """Sends the engine's scheduler had not received at its last step (in flight, or in its front end)."""
        n = min(len(self.recent), max(0, self.sent - self.enqueued))
        return [s for s in itertools.islice(self.recent, len(self.recent) - n, None) if not s.done]

    def pending_prefix_blocks(self, hashes: list[int]) -> int:
        """The longest leading run of these blocks that an unfinished request sent here computes (or did)."""
        if not hashes:
            return 0
        return max((common_run(hashes, s.hashes) for s in self.in_flight.get(hashes[0], ())), default=0)

    def note_sent(self, sent: Sent) -> None:
        self.sent += 1
        self.recent.append(sent)
        if sent.hashes:
            self.in_flight.setdefault(sent.hashes[0], []).append(sent)

    def note_done(self, sent: Sent, enqueued: bool) -> None:
        sent.done = True
        if not enqueued:  # answered before reaching the scheduler (a refusal): it will never show
            self.sent -= 1
        if sent.hashes:
            same = self.in_flight.get(sent.hashes[0], [])
            if sent in same:
                same.remove(sent)
            if not same:
                self.in_flight.pop(sent.hashes[0], None)


def owned_blocks(sent_blocks: set[int], hashes: list[int]) -> int:
    """Leading blocks of a prompt that were sent to this worker before, cached there now or not."""
    return leading_run(hashes, sent_blocks)


def effective_cached(probe: dict[str, Any]) -> int:
    """Prefix tokens this request will not prefill there: cached now, or computed by a request queued or
    running there (or sent there by the oracle) before this one is scheduled."""
    return max(probe["cached_tokens"], probe.get("pending_prefix_tokens", 0))


def predict_ttft_s(preset: Preset, probe: dict[str, Any], extra_ahead_tokens: int = 0,
                   extra_ahead_blocks: int = 0) -> float:
    """Predicted TTFT (simulated seconds) of the probed request on the probed worker (see module docstring)."""
    running, waiting = probe["running"], probe["waiting"]
    r = len(running)
    budget = max(1, probe["max_num_batched_tokens"] - r)
    mine = max(1, probe["prompt_tokens"] - effective_cached(probe))
    ahead = sum(w[0] for w in waiting) + sum(x[0] for x in running) + extra_ahead_tokens
    total = ahead + mine
    steps = math.ceil(total / budget)
    avg_ctx = (sum(x[3] for x in running) / r) if r else 0.0
    chunk = min(total, budget)
    step = step_time_s(preset, StepWork(prefill_tokens=chunk, decode_seqs=r, prefill_seqs=1,
                                        kv_tokens_read=int(r * avg_ctx + chunk), attention_pairs=chunk * chunk // 2))
    vit = 8.0 * preset.vit_params * probe["media_tokens_uncached"] / (preset.peak_flops * preset.mfu)
    t = steps * step + vit
    # eviction: what is allocated beyond the empty free blocks throws cached prefixes out (priced, not waited)
    per_token = step_time_s(preset, StepWork(prefill_tokens=budget, prefill_seqs=1)) / budget
    evict_blocks = max(0, -(-mine // probe["block_size"]) + extra_ahead_blocks
                       + sum(-(-w[0] // probe["block_size"]) for w in waiting)
                       - probe.get("free_empty_blocks", probe["free_blocks"]))
    t += EVICT_WEIGHT * min(evict_blocks, probe["free_blocks"]) * probe["block_size"] * per_token
    # KV: blocks the queue ahead and this request need beyond what is free now
    bs = probe["block_size"]
    need = (-(-mine // bs) + sum(-(-w[0] // bs) for w in waiting) + extra_ahead_blocks
            + sum(-(-x[0] // bs) for x in running))
    deficit = need - probe["free_blocks"]
    if deficit > 0 and running:
        decode_step = step_time_s(preset, StepWork(decode_seqs=r, kv_tokens_read=int(r * avg_ctx)))
        freed = 0
        for _prefill, rest_decode, held, _ in sorted(running, key=lambda x: x[1]):
            freed += held
            if freed >= deficit:
                t += rest_decode * decode_step
                break
        else:
            t += max(x[1] for x in running) * decode_step * math.ceil(deficit / max(1, freed))
    if r + len(waiting) >= probe["max_num_seqs"] and running:
        t += min(x[1] for x in running) * step_time_s(preset, StepWork(decode_seqs=r))
    return t


class _Prompt:
    """What kv_aware's prefix bonus reads of a request."""

    __slots__ = ("prompt_tokens",)

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens


def kv_aware_cost(probe: dict[str, Any], cached: int, unseen: list[Sent]) -> float:
    """kvroute's kv_aware cost(w) (proxy/routing/kv_aware.py, its default knobs) on the probed worker's true state; `unseen`:
    what the oracle sent there that the probe may not show yet (counted as waiting, uncached). Without the eviction
    term: the probe names the cached blocks, not which of them were reused."""
    bs = probe["block_size"]
    capacity = probe["num_blocks"] * bs
    usage = (probe["num_blocks"] - probe["free_blocks"] + sum(s.blocks for s in unseen)) / probe["num_blocks"]
    queue = len(probe["waiting"]) + len(unseen)
    in_flight = queue + len(probe["running"])
    backlog = (sum(w[0] for w in probe["waiting"]) + sum(r[0] for r in probe["running"])
               + sum(s.uncached_tokens for s in unseen))
    return (usage + KV_AWARE.queue_weight * queue + KV_AWARE.inflight_weight * in_flight
            + KV_AWARE.backlog_weight * backlog / capacity
            - PREFIX_BONUS(_Prompt(probe["prompt_tokens"]), cached, capacity, usage))  # type: ignore[arg-type]
