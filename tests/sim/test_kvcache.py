"""The paged KV cache: block accounting, prefix-cache hits by hash chain, LRU eviction."""

from __future__ import annotations

from backends.sim.kvcache import KVCache


def test_allocation_is_refused_without_change_when_blocks_run_out():
    kv = KVCache(num_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 0, 48)  # 3 blocks
    assert not kv.allocate_slots("b", 0, 32)  # needs 2, 1 free
    assert kv.num_used_blocks == 3 and kv.blocks_of("b") == []
    kv.check_invariants()
    kv.free("a")
    assert kv.usage == 0.0
    kv.check_invariants()


def test_a_second_request_with_the_same_prefix_reuses_full_blocks_but_computes_the_last_token():
    kv = KVCache(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # 12 tokens = 3 full blocks
    assert kv.allocate_slots("a", 0, len(prompt))
    kv.cache_full_blocks("a", prompt, len(prompt))
    kv.free("a")
    assert kv.usage == 0.0 and kv.num_cached_blocks == 3

    hits = kv.find_cached_prefix(prompt)
    assert len(hits) == 2  # the last block is recomputed so the model has logits for the last token
    longer = prompt + [7, 8, 9, 10, 11]
    assert len(kv.find_cached_prefix(longer)) == 3
    different_start = [1] + prompt[1:]
    assert kv.find_cached_prefix(different_start) == []  # the chain breaks at the first block


def test_shared_cached_blocks_are_reference_counted():
    kv = KVCache(num_blocks=8, block_size=4)
    prompt = list(range(8)) + [99]
    assert kv.allocate_slots("a", 0, len(prompt))
    kv.cache_full_blocks("a", prompt, len(prompt))
    hits = kv.find_cached_prefix(prompt)
    assert len(hits) == 2
    assert kv.allocate_slots("b", 8, 1, hits)
    assert kv.num_used_blocks == 4  # a: 3, b: 2 shared + 1 own
    kv.check_invariants()
    kv.free("a")
    assert kv.num_used_blocks == 3  # b still holds the shared blocks
    kv.free("b")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    kv = KVCache(num_blocks=4, block_size=2)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    for rid, prompt in (("old", old), ("new", new)):
        assert kv.allocate_slots(rid, 0, 4)
        kv.cache_full_blocks(rid, prompt, 4)
        kv.free(rid)
    assert kv.allocate_slots("x", 0, 2)  # one block: must evict from the oldest request's tail first
    assert kv.evictions == 1
    assert len(kv.find_cached_prefix(new + [0])) == 2
    assert len(kv.find_cached_prefix(old + [0])) == 1  # its tail block went, its head survived
    kv.check_invariants()
