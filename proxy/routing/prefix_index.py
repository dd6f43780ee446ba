"""A bounded-memory index of which worker has recently seen which prompt prefix.

Owns prefix-block -> workers bookkeeping with LRU eviction and a freshness limit; it does not
decide anything (kv_aware and prefix policies read it). Keys are request.py's chained block
hashes, so a hit on block i means the whole prompt up to block i was seen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

# 65536 blocks of ~32 tokens cover ~2M prompt tokens in about 20 MB of proxy memory.
DEFAULT_MAX_BLOCKS = 65536
# Engines evict cached prefixes under pressure; an entry older than this is not trusted.
DEFAULT_TTL_S = 600.0


class PrefixIndex:
    """hash(prefix up to block i) -> {worker_id: last time it was routed there}, LRU-bounded."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._blocks: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int], worker_ids: Collection[str], now: float) -> dict[str, int]:
        """For each candidate worker, how many leading blocks of `hashes` it has (absent: none)."""
        depth: dict[str, int] = {}
        oldest = now - self.ttl_s
        blocks = self._blocks
        for i, block_hash in enumerate(hashes):
            holders = blocks.get(block_hash)
            if not holders:
                break
            found = False
            for worker_id, seen_at in holders.items():
                if seen_at >= oldest and worker_id in worker_ids:
                    depth[worker_id] = i + 1
                    found = True
            if not found:
                break
        return depth

    def insert(self, hashes: Sequence[int], worker_id: str, now: float) -> None:
        """Record that `worker_id` now holds every block of this prompt."""
        blocks = self._blocks
        # Newest-last order with the prompt's head touched last: the LRU end loses long tails
        # before the shared heads (system prompts) that most requests reuse.
        for block_hash in reversed(hashes):
            holders = blocks.get(block_hash)
            if holders is None:
                blocks[block_hash] = {worker_id: now}
            else:
                holders[worker_id] = now
                blocks.move_to_end(block_hash)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
