"""A bounded-memory index of which worker has recently seen which prompt prefix.

Owns prefix-block -> workers bookkeeping with LRU eviction and a freshness limit, and per worker
the tokens it is believed to cache (resident) and to have reused (hot); it decides nothing
(kv_cost, kv_aware and prefix policies read it). Keys are request.py's chained block hashes, so
a hit on block i means the whole prompt up to block i was seen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

# 65536 blocks of ~32 tokens cover ~2M prompt tokens in about 20 MB of proxy memory.
DEFAULT_MAX_BLOCKS = 65536
# Engines evict cached prefixes under pressure; an entry older than this is not trusted.
DEFAULT_TTL_S = 600.0


class _Block:
    """One prefix block: its estimated tokens and, per worker, [last routed at, times routed]."""

    __slots__ = ("tokens", "holders")

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.holders: dict[str, list[float]] = {}


class PrefixIndex:
    """hash(prefix up to block i) -> workers that were sent it (and when), LRU-bounded.

    A block sent to the same worker twice or more is "hot" there: evicting it from that engine
    means a later request pays its prefill again. hot_tokens(w) sums those blocks' tokens.
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._resident: dict[str, int] = {}
        self._hot: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int], worker_ids: Collection[str] | None, now: float) -> dict[str, int]:
        """For each worker (among `worker_ids`; None: any), how many leading blocks of `hashes` it has."""
        depth: dict[str, int] = {}
        oldest = now - self.ttl_s
        blocks = self._blocks
        for i, block_hash in enumerate(hashes):
            block = blocks.get(block_hash)
            if block is None:
                break
            found = False
            for worker_id, entry in block.holders.items():
                if entry[0] >= oldest and (worker_ids is None or worker_id in worker_ids):
                    depth[worker_id] = i + 1
                    found = True
            if not found:
                break
        return depth

    def insert(self, hashes: Sequence[int], worker_id: str, now: float,
               cum_tokens: Sequence[int] | None = None) -> None:
        """Record that `worker_id` now holds every block of this prompt (cum_tokens: request.prefix_tokens)."""
        blocks = self._blocks
        # Newest-last order with the prompt's head touched last: the LRU end loses long tails
        # before the shared heads (system prompts) that most requests reuse.
        for i in range(len(hashes) - 1, -1, -1):
            block_hash = hashes[i]
            block = blocks.get(block_hash)
            if block is None:
                tokens = 0
                if cum_tokens is not None and i < len(cum_tokens):
                    tokens = cum_tokens[i] - (cum_tokens[i - 1] if i else 0)
                block = blocks[block_hash] = _Block(tokens)
            else:
                blocks.move_to_end(block_hash)
            entry = block.holders.get(worker_id)
            if entry is None:
                block.holders[worker_id] = [now, 1.0]
                self._resident[worker_id] = self._resident.get(worker_id, 0) + block.tokens
            else:
                entry[0] = now
                entry[1] += 1.0
                if entry[1] == 2.0:
                    self._hot[worker_id] = self._hot.get(worker_id, 0) + block.tokens
        while len(blocks) > self.max_blocks:
            _, old = blocks.popitem(last=False)
            for holder, entry in old.holders.items():
                self._resident[holder] -= old.tokens
                if entry[1] >= 2.0:
                    self._hot[holder] -= old.tokens

    def resident_tokens(self, worker_id: str) -> int:
        """Prompt tokens this index believes `worker_id` caches (an upper bound: engines evict too)."""
        return self._resident.get(worker_id, 0)

    def hot_tokens(self, worker_id: str) -> int:
        """Of those, the tokens of blocks routed to `worker_id` at least twice (reused prefixes)."""
        return self._hot.get(worker_id, 0)
