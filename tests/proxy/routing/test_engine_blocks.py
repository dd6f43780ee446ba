"""The proxy's view of each engine's cache, fed by KV-event batches in load reports (proxy/routing/engine_blocks.py).

Through the registry, as reports reach it: a snapshot makes a view exact, each next batch keeps it so; a
skipped batch, a restart or an impossible size drops it until the worker sends a snapshot, which the answer
to its report asks for (worker.kv_resync).
"""

from __future__ import annotations

import random
import tracemalloc

import pytest

from proxy.kvevents import KvEventBatch, pack_hashes, unpack_hashes
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.routing.engine_blocks import EngineBlocks
from proxy.workers.registry import Registry

SCHEME = {"block_size": 16, "hash_algo": "sha256_cbor", "hash_seed": "vllm-none-hash"}


class Fleet:
    def __init__(self) -> None:
        self.registry = Registry()
        self.blocks = EngineBlocks()
        self.registry.add_listener(self.blocks.on_registry_event)
        self.seq: dict[str, int] = {}

    def register(self, wid: str, boot: str = "boot-1") -> None:
        self.registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}:1", models=["m"], boot_id=boot))
        self.seq[wid] = 0

    def report(self, wid: str, batch: KvEventBatch | None, boot: str = "boot-1", capacity_tokens: int = 16 * 1000) -> bool:
        self.seq[wid] += 1
        report = LoadReport(worker_id=wid, url=f"http://{wid}:1", models=["m"], kv_cache_usage=0.1,
                            kv_capacity_tokens=capacity_tokens, num_running=0, num_waiting=0, seq=self.seq[wid],
                            boot_id=boot, kv_events=batch)
        assert self.registry.record_report(wid, report)
        return self.registry.get(wid).kv_resync

    def snapshot(self, wid: str, seq: int, hashes: list[int], **extra) -> bool:
        return self.report(wid, KvEventBatch(seq=seq, snapshot=True, stored=pack_hashes(hashes), **SCHEME, **extra))

    def delta(self, wid: str, seq: int, stored=(), removed=(), cleared=False) -> bool:
        return self.report(wid, KvEventBatch(seq=seq, stored=pack_hashes(list(stored)),
                                             removed=pack_hashes(list(removed)), cleared=cleared))


@pytest.fixture
def fleet() -> Fleet:
    f = Fleet()
    f.register("a")
    f.register("b")
    return f


def test_hashes_pack_into_base64_and_back():
    hashes = [0, 1, 2**63, 2**64 - 1]
    assert unpack_hashes(pack_hashes(hashes)) == tuple(hashes)
    with pytest.raises(ValueError):
        unpack_hashes("not base64!")
    with pytest.raises(ValueError):
        unpack_hashes("AAAA")  # 3 bytes: not whole 64-bit hashes


def test_a_snapshot_then_each_next_batch_keep_the_view_equal_to_the_engine(fleet):
    assert fleet.snapshot("a", 1, [1, 2, 3]) is False
    assert fleet.blocks.match([1, 2, 3, 4]) == {"a": 3}
    assert fleet.delta("a", 2, stored=[4], removed=[3]) is False
    assert fleet.blocks.match([1, 2, 3, 4]) == {"a": 2}  # the engine evicted block 3: its prompt stops there
    assert fleet.blocks.match([1, 2, 4]) == {"a": 3}
    assert fleet.blocks.view("a").exact
    assert set(fleet.blocks.exact_by_scheme()) == {fleet.blocks.view("a").scheme}


def test_match_follows_each_holder_to_its_first_miss_and_stays_among_the_workers_asked(fleet):
    fleet.snapshot("a", 1, [1, 2, 3, 4])
    fleet.snapshot("b", 1, [1, 2, 4, 9])  # b lost block 3 (an engine evicts any block, not only tails)
    assert fleet.blocks.match([1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert fleet.blocks.match([1, 2, 3, 4], {"b"}) == {"b": 2}
    assert fleet.blocks.match([7, 1, 2]) == {}


def test_a_skipped_batch_drops_the_view_until_the_worker_sends_a_snapshot(fleet):
    fleet.snapshot("a", 1, [1, 2])
    assert fleet.delta("a", 3, stored=[5]) is True  # batch 2 never arrived: the answer asks for a snapshot
    view = fleet.blocks.view("a")
    assert not view.synced and not view.blocks and fleet.blocks.match([1, 2]) == {}
    assert fleet.delta("a", 4, stored=[6]) is True  # deltas on an unknown state are not taken
    assert fleet.snapshot("a", 5, [1, 2, 5, 6]) is False
    assert fleet.blocks.match([1, 2, 5, 6]) == {"a": 4} and view.resyncs == 1


def test_a_worker_restart_clears_its_view(fleet):
    fleet.snapshot("a", 1, [1, 2])
    fleet.register("a", boot="boot-2")  # a new process: its engine's cache is another one
    assert fleet.registry.get("a").kv_resync and fleet.blocks.match([1, 2]) == {}
    fleet.report("a", KvEventBatch(seq=1, snapshot=True, **SCHEME), boot="boot-2")
    assert fleet.blocks.view("a").exact and not fleet.registry.get("a").kv_resync


def test_all_blocks_cleared_empties_the_view_and_what_follows_is_taken(fleet):
    fleet.snapshot("a", 1, [1, 2, 3])
    fleet.snapshot("b", 1, [1, 2])
    assert fleet.delta("a", 2, stored=[8], cleared=True) is False
    assert fleet.blocks.match([1, 2]) == {"b": 2} and fleet.blocks.match([8]) == {"a": 1}


def test_a_worker_removed_leaves_nothing_behind(fleet):
    fleet.snapshot("a", 1, [1, 2, 3])
    fleet.snapshot("b", 1, [1, 2])
    fleet.registry.remove("a")
    assert fleet.blocks.view("a") is None and len(fleet.blocks) == 2
    fleet.registry.remove("b")
    assert len(fleet.blocks) == 0


def test_an_incomplete_engine_copy_is_kept_but_not_trusted_for_routing(fleet):
    fleet.snapshot("a", 1, [1, 2], complete=False)
    view = fleet.blocks.view("a")
    assert view.synced and not view.exact and fleet.blocks.exact_by_scheme() == {}
    fleet.delta("a", 2, cleared=True)  # cleared: the worker's copy is whole again
    fleet.report("a", KvEventBatch(seq=3, stored=pack_hashes([4])))
    assert view.exact


def test_an_unreadable_batch_asks_for_a_snapshot(fleet):
    fleet.snapshot("a", 1, [1])
    assert fleet.report("a", KvEventBatch(seq=2, stored="AAAA")) is True
    assert fleet.blocks.match([1]) == {}


def test_no_view_outgrows_its_engine_whatever_the_batches_say(fleet):
    capacity_blocks = 1000
    fleet.report("a", KvEventBatch(seq=1, snapshot=True, capacity_blocks=capacity_blocks, **SCHEME))
    rng = random.Random(5)
    view = fleet.blocks.view("a")
    tracemalloc.start()
    for seq in range(2, 200):  # a flood: stores only, far beyond what the engine can hold
        fleet.delta("a", seq, stored=[rng.getrandbits(64) for _ in range(500)])
        assert len(view.blocks) <= view.max_blocks and len(fleet.blocks) <= view.max_blocks
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert view.resyncs > 0 and not view.synced  # the impossible view was dropped, and a snapshot asked
    assert peak < 2_000_000  # ~1300 blocks at most at any time, not 99000
    oversized = [rng.getrandbits(64) for _ in range(2 * view.max_blocks)]
    assert fleet.report("a", KvEventBatch(seq=300, snapshot=True, stored=pack_hashes(oversized),
                                          capacity_blocks=capacity_blocks, **SCHEME)) is True
    assert len(fleet.blocks) == 0
