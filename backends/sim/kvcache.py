"""Paged KV cache of the sim engine: fixed-size blocks, reference counts, and the prefix cache.

Owns which blocks each request holds and which full blocks are reusable by hash (vLLM v1's
design: a hash chain over full blocks, free blocks kept in LRU order and evicted from the front).
It does not decide who runs; scheduler.py asks it for room and frees what it no longer needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol


class CacheListener(Protocol):
    """Told of every change to the prefix cache (backends/sim/kv_publisher.py publishes them as vLLM's KV events)."""

    def cached(self, request_id: str, index: int, block_hash: int) -> None:
        """Block `index` of the request's table entered the cache under `block_hash`."""

    def evicted(self, block_hash: int) -> None:
        """A cached block was reused for other content."""

    def reset(self) -> None:
        """Every cached block nobody holds was dropped."""


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


# The chain's root. Not None: hash(None) differs from process to process before Python 3.12, and the
# oracle (bench/oracle.py) hashes prompts once in its own process for every sim it probes.
_ROOT_HASH = 0x5F3759DF


def hash_block(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """Hash of one full block, chained on its parent's so equal hashes mean equal prefixes (the same in
    every process: the token ids are, and so are hashes of int tuples)."""
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, tuple(tokens)))


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    hashes: list[int] = []
    parent: int | None = None
    full = len(token_ids) // block_size
    for i in range(full if max_blocks is None else min(full, max_blocks)):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def leading_run(hashes: Sequence[int], members: Container[int]) -> int:
    """How many of these block hashes are in `members`, in a row from the first."""
    n = 0
    for h in hashes:
        if h not in members:
            break
        n += 1
    return n


class KVCache:
    """Blocks, per-request block tables and the prefix cache.

    Usage (what /metrics reports) counts blocks held by requests; cached blocks nobody holds are
    free for reuse, as in vLLM, so usage returns to 0 when the engine is idle.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order: the front is evicted first. Holds every block with ref_cnt 0.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}
        self._tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[int]] = {}  # hashes of the request's full, cached blocks
        self.evictions = 0
        # (True, hash) when a block hash enters the prefix cache, (False, hash) when it leaves; kept only while
        # someone reads it (backends/sim/feed.py), None otherwise
        self.journal: list[tuple[bool, int]] | None = None
        self.listener: CacheListener | None = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_of(self, request_id: str) -> list[Block]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[int] | None = None) -> list[Block]:
        """Longest run of cached blocks matching the prompt's leading full blocks.

        At least one token is always left to compute (the model must produce logits for the last
        one), so a prompt fully in cache reuses all but its last block, as vLLM does. `hashes`, when
        given, are the prompt's full-block hashes already computed (see SimRequest.full_block_hashes).
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size, max_blocks)
        hits: list[Block] = []
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_run(self, hashes: Sequence[int]) -> int:
        """How many of these leading full-block hashes are cached, in a row from the first (no room kept
        for the last token: the caller passes only the blocks a prompt could reuse)."""
        return leading_run(hashes, self._cached) if self.enable_prefix_caching else 0

    def cached_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now."""
        return list(self._cached)

    def num_free_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (allocating them evicts it). O(cached blocks)."""
        return sum(1 for b in self._cached.values() if b.ref_cnt == 0)

    # ---- changes -------------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       cached_prefix: Sequence[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) when blocks run out.

        `cached_prefix` (only on a request's first scheduling) are prefix-cache hits to adopt;
        `num_computed_tokens` already counts them.
        """
        table = self._tables.setdefault(request_id, [])
        required = self.blocks_needed(num_computed_tokens + num_new_tokens) - len(table) - len(cached_prefix)
        # adopting a cached block that nobody holds takes it out of the free pool too
        adopted_from_free = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if max(required, 0) > self.num_free_blocks - adopted_from_free:
            if not table:
                del self._tables[request_id]
            return False
        for block in cached_prefix:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            table.append(block)
        if cached_prefix:
            self._hashes[request_id] = [b.block_hash for b in cached_prefix if b.block_hash is not None]
        for _ in range(max(required, 0)):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # evict: the block's old content is gone
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    if self.journal is not None:
                        self.journal.append((False, block.block_hash))
                    if self.listener is not None:
                        self.listener.evicted(block.block_hash)
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            table.append(block)
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        hashes = self._hashes.setdefault(request_id, [])
        full = min(num_computed_tokens // self.block_size, len(table))
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), full):
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)
            block = table[i]
            if block.block_hash is None and parent not in self._cached:
                block.block_hash = parent
                self._cached[parent] = block
                if self.journal is not None:
                    self.journal.append((True, parent))
                if self.listener is not None:
                    self.listener.cached(request_id, i, parent)

    def free(self, request_id: str) -> None:
        """Release a request's blocks; the tail goes to the free list first so it is evicted first."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        for block in reversed(table):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        """Drop every cached block nobody holds (vLLM's reset_prefix_cache, which refuses while any is held)."""
        dropped: list[int] = []
        for block in self._free.values():
            if block.block_hash is not None:
                if self._cached.pop(block.block_hash, None) is not None:
                    dropped.append(block.block_hash)
                    if self.journal is not None:
                        self.journal.append((False, block.block_hash))
                block.block_hash = None
        if self.listener is not None:
            if not self._cached:
                self.listener.reset()  # all gone: vLLM says so with one AllBlocksCleared
            else:
                for block_hash in dropped:
                    self.listener.evicted(block_hash)

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (used by tests)."""
        held: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), f"block {block.block_id} ref count"
            assert (block.ref_cnt == 0) == (block.block_id in self._free), f"block {block.block_id} free list"
        assert self.num_used_blocks <= self.num_blocks
        for h, block in self._cached.items():
            assert block.block_hash == h
