"""A bounded-memory index of which worker has recently seen which prompt prefix.

Owns prefix-block -> workers bookkeeping with LRU eviction and a freshness limit, and per worker
the tokens it is believed to cache (resident) and to have reused (hot); it decides nothing
(kv_cost, kv_aware and prefix policies read it). Keys are request.py's chained block hashes, so
a hit on block i means the whole prompt up to block i was seen. Its size and freshness limit are
config.yaml's `proxy.routing.prefix_index` (routing_config.PrefixIndexConfig). An engine's answer may show it
evicted what the index believed (cache_feedback.py): `forget_before` then sets that worker's horizon, before
which nothing it was sent counts as held.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from itertools import repeat

from proxy.routing_config import PrefixIndexConfig

_DEFAULTS = PrefixIndexConfig()


class _Block:
    """One prefix block: its estimated tokens and, per worker, how often it was routed there (1, or 2 for "twice or more")."""

    __slots__ = ("tokens", "holders")

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.holders: dict[str, int] = {}


class PrefixIndex:
    """hash(prefix up to block i) -> workers that were sent it (and when), LRU-bounded.

    A block sent to the same worker twice or more is "hot" there: evicting it from that engine
    means a later request pays its prefill again. hot_tokens(w) sums those blocks' tokens.

    Speed (a decision at 1000 workers has a few tens of microseconds) rests on what chained hashes
    guarantee: a prompt is always inserted whole, head touched last, so along any chain the
    workers holding block i (and their counts and times) are a subset of those holding block i-1,
    and a tail block leaves the LRU before its head. So match() and insert() find where the
    holders change by bisection instead of walking every block, and insert() refreshes the blocks
    a worker already holds hot (the shared system prompt of most requests) with C-level batch calls.
    The results are those of the block-by-block walk (tests/proxy/routing/test_prefix_index.py checks both).
    """

    def __init__(self, max_blocks: int = _DEFAULTS.max_blocks, ttl_s: float = _DEFAULTS.ttl_s) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._seen: dict[str, dict[int, float]] = {}  # worker -> block hash -> last routed there at
        self._resident: dict[str, int] = {}
        self._hot: dict[str, int] = {}
        # worker -> blocks last sent there before this time are taken as evicted (its engine said so: engines
        # evict the least recently used first). Checked lazily, as the freshness limit is: no scan of the index.
        self._horizon: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def configure(self, knobs: PrefixIndexConfig) -> None:
        """New limits (a config edit): entries are kept, the least recently used beyond a smaller size dropped."""
        self.max_blocks, self.ttl_s = knobs.max_blocks, knobs.ttl_s
        self._evict()

    def _live(self, block_hash: int, worker_ids: Collection[str] | None, oldest: float) -> list[str]:
        block = self._blocks.get(block_hash)
        if block is None:
            return []
        seen = self._seen
        horizon = self._horizon
        if horizon:  # rare: only workers whose engines said they evicted what the index believed
            return [w for w in block.holders
                    if seen[w][block_hash] >= max(oldest, horizon.get(w, oldest))
                    and (worker_ids is None or w in worker_ids)]
        return [w for w in block.holders
                if seen[w][block_hash] >= oldest and (worker_ids is None or w in worker_ids)]

    def match(self, hashes: Sequence[int], worker_ids: Collection[str] | None, now: float) -> dict[str, int]:
        """For each worker (among `worker_ids`; None: any), how many leading blocks of `hashes` it has."""
        depth: dict[str, int] = {}
        if not hashes:
            return depth
        oldest = now - self.ttl_s
        live = self._live
        current = live(hashes[0], worker_ids, oldest)
        last = len(hashes) - 1
        lo = 0
        while current:
            # the holders only shrink along the chain: bisect for the last block still held by as many
            size = len(current)
            if len(live(hashes[last], worker_ids, oldest)) == size:
                lo = last
            else:
                hi = last - 1
                while lo < hi:
                    mid = (lo + hi + 1) >> 1
                    if len(live(hashes[mid], worker_ids, oldest)) == size:
                        lo = mid
                    else:
                        hi = mid - 1
            if lo == last:
                for w in current:
                    depth[w] = last + 1
                break
            following = live(hashes[lo + 1], worker_ids, oldest)
            for w in current:
                if w not in following:
                    depth[w] = lo + 1
            current = following
            lo += 1
        return depth

    def insert(self, hashes: Sequence[int], worker_id: str, now: float,
               cum_tokens: Sequence[int] | None = None) -> None:
        """Record that `worker_id` now holds every block of this prompt (cum_tokens: request.prefix_tokens)."""
        blocks = self._blocks
        seen = self._seen.get(worker_id)
        if seen is None:
            seen = self._seen[worker_id] = {}
        # blocks 0..hot_end-1 are hot on worker_id already: only their time and LRU place change
        hot_end = self._hot_prefix(hashes, worker_id)
        # Newest-last order with the prompt's head touched last: the LRU end loses long tails
        # before the shared heads (system prompts) that most requests reuse.
        self._touch(hashes, hot_end, len(hashes), worker_id, seen, now, cum_tokens)
        if hot_end:
            head = hashes[:hot_end]
            try:
                deque(map(blocks.move_to_end, reversed(head)), maxlen=0)
            except KeyError:  # not a chain after all: do it block by block
                self._touch(hashes, 0, hot_end, worker_id, seen, now, cum_tokens)
            else:
                seen.update(zip(head, repeat(now)))
        self._evict()

    def _evict(self) -> None:
        """Drop the least recently used blocks beyond max_blocks."""
        blocks = self._blocks
        while len(blocks) > self.max_blocks:
            old_hash, old = blocks.popitem(last=False)
            for holder, count in old.holders.items():
                self._seen[holder].pop(old_hash, None)
                self._resident[holder] -= old.tokens
                if count >= 2:
                    self._hot[holder] -= old.tokens

    def _hot_prefix(self, hashes: Sequence[int], worker_id: str) -> int:
        """How many leading blocks of `hashes` are hot on `worker_id` (bisection: hotness only shrinks along a chain)."""
        blocks = self._blocks
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            block = blocks.get(hashes[mid - 1])
            if block is not None and block.holders.get(worker_id, 0) >= 2:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _touch(self, hashes: Sequence[int], start: int, end: int, worker_id: str, seen: dict[int, float], now: float,
               cum_tokens: Sequence[int] | None) -> None:
        """Blocks end-1 down to start: create or move to the LRU end, count and stamp worker_id's visit."""
        blocks = self._blocks
        for i in range(end - 1, start - 1, -1):
            block_hash = hashes[i]
            block = blocks.get(block_hash)
            if block is None:
                tokens = 0
                if cum_tokens is not None and i < len(cum_tokens):
                    tokens = cum_tokens[i] - (cum_tokens[i - 1] if i else 0)
                block = blocks[block_hash] = _Block(tokens)
            else:
                blocks.move_to_end(block_hash)
            seen[block_hash] = now
            count = block.holders.get(worker_id, 0)
            if count == 0:
                block.holders[worker_id] = 1
                self._resident[worker_id] = self._resident.get(worker_id, 0) + block.tokens
            elif count == 1:
                block.holders[worker_id] = 2
                self._hot[worker_id] = self._hot.get(worker_id, 0) + block.tokens

    def seen_at(self, block_hash: int, worker_id: str) -> float | None:
        """When the block was last sent to `worker_id` (None: never, or forgotten)."""
        seen = self._seen.get(worker_id)
        return seen.get(block_hash) if seen is not None else None

    def forget_before(self, worker_id: str, when: float) -> None:
        """`worker_id`'s engine no longer holds what it was sent before `when`: match() stops naming it for those
        blocks (a later insert makes a block count again). The horizon only moves forward."""
        if when > self._horizon.get(worker_id, float("-inf")):
            self._horizon[worker_id] = when

    def forget_worker(self, worker_id: str) -> None:
        """The worker is gone: its horizon goes (its blocks leave with the LRU, as they did before)."""
        self._horizon.pop(worker_id, None)

    def resident_tokens(self, worker_id: str) -> int:
        """Prompt tokens this index believes `worker_id` caches (an upper bound: engines evict too)."""
        return self._resident.get(worker_id, 0)

    def hot_tokens(self, worker_id: str) -> int:
        """Of those, the tokens of blocks routed to `worker_id` at least twice (reused prefixes)."""
        return self._hot.get(worker_id, 0)

    def hot_by_worker(self) -> Mapping[str, int]:
        """hot_tokens() of every worker that has any (a live read-only view, for a decision's loop)."""
        return self._hot
