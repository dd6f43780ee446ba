"""The worker's copy of its engine's cache and the batches it sends the proxy (backends/kv_mirror.py)."""

from __future__ import annotations

import tracemalloc

from backends.kv_mirror import MAX_PENDING, KvMirror
from proxy.kvevents import unpack_hashes


def mirror(**kw) -> KvMirror:
    m = KvMirror("sha256_cbor", "vllm-none-hash", block_size=16, capacity_blocks=kw.pop("capacity_blocks", 1000), **kw)
    first = m.take_batch(now=0.0)
    assert first is not None and first.snapshot and first.block_size == 16  # every boot starts with a snapshot
    return m


def test_changes_are_netted_per_block_between_two_reports():
    m = mirror()
    m.stored([1, 2, 3])
    m.removed([3])  # stored and evicted within one report interval: nothing to tell
    m.stored([2])  # a second block with the same hash (vLLM may hold two): still one block to the proxy
    batch = m.take_batch(now=1.0)
    assert not batch.snapshot and set(unpack_hashes(batch.stored)) == {1, 2} and batch.removed == ""
    m.removed([2])  # one of the two copies goes: the hash is still cached
    assert m.take_batch(now=2.0) is None
    m.removed([2, 1])
    batch = m.take_batch(now=3.0)
    assert set(unpack_hashes(batch.removed)) == {1, 2} and batch.seq == 3


def test_all_blocks_cleared_goes_first_in_the_next_batch():
    m = mirror()
    m.stored([1, 2])
    m.take_batch(now=1.0)
    m.cleared()
    m.stored([7])
    batch = m.take_batch(now=2.0)
    assert batch.cleared and unpack_hashes(batch.stored) == (7,) and batch.removed == ""


def test_a_resync_or_the_snapshot_interval_sends_everything():
    m = mirror(snapshot_every_s=60.0)
    m.stored([1, 2])
    m.take_batch(now=1.0)
    m.resync()
    batch = m.take_batch(now=2.0)
    assert batch.snapshot and set(unpack_hashes(batch.stored)) == {1, 2} and batch.capacity_blocks == 1000
    assert m.take_batch(now=30.0) is None
    assert m.take_batch(now=62.5).snapshot  # replicas that missed a message are exact again


def test_lost_events_make_the_copy_incomplete_until_the_engine_clears_its_cache():
    m = mirror()
    m.stored([1])
    m.lost()
    batch = m.take_batch(now=1.0)
    assert batch.snapshot and not batch.complete and batch.stored == ""
    m.removed([1])  # the removal of a block stored before the loss changes nothing told
    m.stored([5])
    assert not m.take_batch(now=2.0).complete
    m.cleared()
    assert m.take_batch(now=3.0).complete


def test_a_flood_of_events_never_grows_the_worker_past_its_bounds():
    m = mirror(capacity_blocks=10_000)
    tracemalloc.start()
    next_hash = 0
    for _ in range(40):  # 40 x 5000 stores with no removal: removals were lost somewhere
        m.stored(range(next_hash, next_hash + 5000))
        next_hash += 5000
        assert len(m) <= m.max_blocks
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8_000_000  # ~12k blocks at most, not 200k
    assert m.stats["lost"] > 0
    batch = m.take_batch(now=1.0)
    assert batch.snapshot and not batch.complete and len(unpack_hashes(batch.stored)) <= m.max_blocks


def test_more_pending_changes_than_fit_in_a_batch_become_a_snapshot():
    m = mirror(capacity_blocks=None)
    m.stored(range(MAX_PENDING + 10))
    m.removed(range(0, MAX_PENDING + 10, 2))
    batch = m.take_batch(now=1.0)
    assert batch.snapshot and len(unpack_hashes(batch.stored)) == (MAX_PENDING + 10) // 2


def test_the_block_size_learnt_from_the_first_event_goes_out_in_a_snapshot():
    m = KvMirror("sha256_cbor", "vllm-none-hash")  # a vLLM worker: the block size comes with the events
    assert m.take_batch(now=0.0).block_size is None
    m.stored([1, 2], block_size=128)
    batch = m.take_batch(now=1.0)
    assert batch.snapshot and batch.block_size == 128 and set(unpack_hashes(batch.stored)) == {1, 2}


def test_an_engine_that_stored_nothing_yet_still_names_its_block_size_from_its_metrics():
    """A worker whose engine has served nothing must still give the proxy an exact (empty) view: the block size
    comes from the engine's metrics (vLLM's cache_config_info) before any stored block names it."""
    from backends.kv_subscriber import EngineKvFeed

    feed = EngineKvFeed("sha256_cbor", "vllm-none-hash")
    assert feed.mirror.take_batch(now=0.0).block_size is None
    feed.capacity_from(4096, block_size=128)
    batch = feed.mirror.take_batch(now=1.0)
    assert batch.snapshot and batch.complete and batch.block_size == 128 and batch.capacity_blocks == 32
    feed.capacity_from(4096, block_size=16)  # the first size it learnt stays (an engine's block size is fixed)
    assert feed.mirror.block_size == 128
