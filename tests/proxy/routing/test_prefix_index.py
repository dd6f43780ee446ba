"""The prefix index answers as a block-by-block walk would, while bisecting along chains and batching refreshes."""

from __future__ import annotations

import random
from collections import OrderedDict

from proxy.routing.prefix_index import PrefixIndex


class WalkIndex:
    """The straightforward index (every block visited on match and insert): the reference."""

    def __init__(self, max_blocks: int, ttl_s: float) -> None:
        self.max_blocks, self.ttl_s = max_blocks, ttl_s
        self.blocks: OrderedDict[int, tuple[int, dict[str, list[float]]]] = OrderedDict()
        self.resident: dict[str, int] = {}
        self.hot: dict[str, int] = {}

    def match(self, hashes, worker_ids, now):
        depth: dict[str, int] = {}
        for i, h in enumerate(hashes):
            block = self.blocks.get(h)
            if block is None:
                break
            found = False
            for w, entry in block[1].items():
                if entry[0] >= now - self.ttl_s and (worker_ids is None or w in worker_ids):
                    depth[w], found = i + 1, True
            if not found:
                break
        return depth

    def insert(self, hashes, w, now, cum):
        for i in range(len(hashes) - 1, -1, -1):
            h = hashes[i]
            if h not in self.blocks:
                self.blocks[h] = (cum[i] - (cum[i - 1] if i else 0), {})
            else:
                self.blocks.move_to_end(h)
            tokens, holders = self.blocks[h]
            entry = holders.get(w)
            if entry is None:
                holders[w] = [now, 1.0]
                self.resident[w] = self.resident.get(w, 0) + tokens
            else:
                entry[0], entry[1] = now, entry[1] + 1
                if entry[1] == 2.0:
                    self.hot[w] = self.hot.get(w, 0) + tokens
        while len(self.blocks) > self.max_blocks:
            _, (tokens, holders) = self.blocks.popitem(last=False)
            for w, entry in holders.items():
                self.resident[w] -= tokens
                if entry[1] >= 2.0:
                    self.hot[w] -= tokens


def chains(rng: random.Random, heads: int, n: int) -> list[list[int]]:
    """Chained-hash prompts: a shared head (a system prompt, or a prefix of one) plus a unique or repeated tail."""
    roots = [[rng.getrandbits(63) for _ in range(rng.randint(1, 40))] for _ in range(heads)]
    tails: list[list[int]] = []
    out = []
    for _ in range(n):
        head = roots[rng.randrange(heads)]
        head = head[:rng.randint(1, len(head))] if rng.random() < 0.3 else head
        if tails and rng.random() < 0.5:
            tail = rng.choice(tails)
        else:
            tail = [rng.getrandbits(63) for _ in range(rng.randint(0, 6))]
            tails.append(tail)
        # chained: a block's hash depends on everything before it
        out.append(head + [hash((tuple(head), x)) for x in tail])
    return out


def test_match_insert_and_token_counts_equal_the_block_by_block_walk():
    for seed, max_blocks in ((1, 64), (2, 300), (3, 100_000)):
        rng = random.Random(seed)
        fast, walk = PrefixIndex(max_blocks=max_blocks, ttl_s=30.0), WalkIndex(max_blocks, 30.0)
        workers = [f"w{i}" for i in range(6)]
        prompts = chains(rng, 5, 200)
        now = 0.0
        for step in range(3000):
            now += rng.random() * (0.05 if rng.random() < 0.99 else 20.0)  # now and then past the TTL
            hashes = rng.choice(prompts)
            among = None if rng.random() < 0.7 else set(rng.sample(workers, 3))
            assert fast.match(hashes, among, now) == walk.match(hashes, among, now), step
            w = rng.choice(workers)
            cum = [sum(range(i + 2)) for i in range(len(hashes))]
            fast.insert(hashes, w, now, cum)
            walk.insert(hashes, w, now, cum)
            assert len(fast) == len(walk.blocks)
            assert all(fast.resident_tokens(x) == walk.resident.get(x, 0) for x in workers)
            assert all(fast.hot_tokens(x) == walk.hot.get(x, 0) for x in workers)
        assert list(fast._blocks) == list(walk.blocks)  # the same LRU order: the same blocks evicted next


def test_a_prompt_sent_twice_is_hot_and_an_expired_one_is_not_matched():
    index = PrefixIndex(ttl_s=10.0)
    index.insert([1, 2, 3], "a", 0.0, [10, 20, 30])
    index.insert([1, 2], "b", 1.0, [10, 20])
    assert index.match([1, 2, 3, 4], None, 2.0) == {"a": 3, "b": 2}
    assert index.hot_tokens("a") == 0
    index.insert([1, 2, 3], "a", 3.0, [10, 20, 30])
    assert index.hot_tokens("a") == 30 and index.resident_tokens("a") == 30
    assert index.match([1, 2, 3], None, 12.0) == {"a": 3}  # b's visit at 1.0 is older than the TTL
    assert index.match([1, 2, 3], {"b"}, 12.0) == {}
