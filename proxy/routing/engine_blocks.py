"""Which blocks each engine's prefix cache holds, as its own KV events said (vLLM's BlockStored/BlockRemoved).

Owns, per worker whose reports carry KV-event batches (proxy/kvevents.py), the set of its engine's block
hashes, the batch sequence that keeps it exact, and one inverted index over all of them (block hash -> the
workers holding it) that answers "how many leading blocks of this prompt does each worker hold". It decides
nothing (cached_prefix.py turns depths into tokens for the policies) and does no I/O: it is a registry
listener, so it sees every report the registry records, this replica's and (state: redis) every other's.

A view is `synced` from a snapshot on: each batch must carry the next `seq`. A skipped batch, a batch that
cannot be read, a new boot of the worker or more blocks than its engine can hold leave the view `awaiting`
(nothing believed) until the worker sends a snapshot, which it does when the answer to its report says
`kv_resync` (the worker's own flag, set here), after any report it could not deliver, after registering, and
every few tens of seconds for replicas that lost a message on the way.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from proxy.kvevents import KvEventBatch, unpack_hashes
from proxy.protocol import LoadReport
from proxy.routing.block_hash import HashScheme
from proxy.workers.registry import Worker

log = logging.getLogger("kvroute.engine_blocks")

# No worker's view grows past this many blocks, whatever its engine says it holds: ~16M prompt tokens at vLLM's
# GPU block size of 16, ~130 MB of proxy memory (a block held costs ~130 bytes: the int, its place in the
# worker's set and in the index; measured with tracemalloc, docs/design/kv-events.md).
MAX_WORKER_BLOCKS = 1 << 20
# Batches are netted by the worker, so a view never exceeds the engine's capacity; this slack covers a
# capacity that changed between snapshots.
CAPACITY_SLACK = 1.25


class EngineView:
    """One worker's engine, as its KV events describe it."""

    __slots__ = ("worker_id", "boot_id", "synced", "complete", "next_seq", "scheme", "capacity_blocks", "blocks",
                 "resyncs")

    def __init__(self, worker_id: str, boot_id: str | None) -> None:
        self.worker_id = worker_id
        self.boot_id = boot_id
        self.synced = False
        self.complete = False
        self.next_seq = 0
        self.scheme: HashScheme | None = None
        self.capacity_blocks: int | None = None
        self.blocks: set[int] = set()
        self.resyncs = 0  # times this view was found inconsistent and asked for a snapshot

    @property
    def exact(self) -> bool:
        """Routing may take this view as the engine's whole cache."""
        return self.synced and self.complete and self.scheme is not None and self.scheme.supported

    @property
    def max_blocks(self) -> int:
        if self.capacity_blocks is None:
            return MAX_WORKER_BLOCKS
        return min(MAX_WORKER_BLOCKS, int(self.capacity_blocks * CAPACITY_SLACK) + 64)


class EngineBlocks:
    """Every reporting engine's cached blocks; register `on_registry_event` as a registry listener."""

    def __init__(self) -> None:
        self._views: dict[str, EngineView] = {}
        # block hash -> its holder, when one worker holds it (most blocks: C-level bulk updates), else -> holders
        self._single: dict[int, str] = {}
        self._shared: dict[int, set[str]] = {}
        self._by_scheme: dict[HashScheme, frozenset[str]] | None = {}  # exact views by scheme; None: recompute

    def __len__(self) -> int:
        return len(self._single) + len(self._shared)

    # --- feeding ------------------------------------------------------------------------------
    def on_registry_event(self, kind: str, worker: Worker, detail: Any) -> None:
        if kind == "report":
            if detail.kv_events is not None or worker.worker_id in self._views:
                self.apply_report(worker, detail)
        elif kind == "remove":
            self.forget(worker.worker_id)
        elif kind == "register":
            view = self._views.get(worker.worker_id)
            boot_id = detail.boot_id if detail is not None else None
            if view is not None and view.boot_id != boot_id:
                self._reset(view, boot_id, "the worker restarted")
                worker.kv_resync = True

    def apply_report(self, worker: Worker, report: LoadReport) -> None:
        """Take the report's batch (if any) into the worker's view; worker.kv_resync says whether a snapshot is wanted."""
        wid = worker.worker_id
        view = self._views.get(wid)
        if view is None:
            view = self._views[wid] = EngineView(wid, report.boot_id)
        elif view.boot_id != report.boot_id:
            self._reset(view, report.boot_id, "the worker restarted")
        batch = report.kv_events
        if batch is not None:
            was = (view.exact, view.scheme)
            try:
                self._apply(view, batch, report)
            except ValueError as exc:
                self._reset(view, view.boot_id, f"unreadable batch ({exc})")
            if (view.exact, view.scheme) != was:
                self._by_scheme = None
        worker.kv_resync = not view.synced

    def _apply(self, view: EngineView, batch: KvEventBatch, report: LoadReport) -> None:
        if batch.snapshot:
            stored = set(unpack_hashes(batch.stored))
            if not view.synced:
                self._clear(view)
            if batch.block_size is not None:
                view.scheme = HashScheme(batch.block_size, batch.hash_algo or "", batch.hash_seed or "")
            view.capacity_blocks = batch.capacity_blocks or (
                report.kv_capacity_tokens // view.scheme.block_size if view.scheme and report.kv_capacity_tokens
                else None)
            if len(stored) > view.max_blocks:
                raise ValueError(f"a snapshot of {len(stored)} blocks, over {view.max_blocks}")
            # a view in step differs from the snapshot in a few blocks at most: apply the difference
            self._remove(view, view.blocks - stored)
            self._add(view, stored)
            view.synced = True
        elif not view.synced:
            return  # waiting for a snapshot: deltas against an unknown state mean nothing
        elif batch.seq != view.next_seq:
            self._reset(view, view.boot_id, f"batch {batch.seq} where {view.next_seq} was due")
            return
        else:
            removed, stored = unpack_hashes(batch.removed), unpack_hashes(batch.stored)
            if batch.cleared:
                self._clear(view)
            self._remove(view, removed)
            self._add(view, stored)
            if len(view.blocks) > view.max_blocks:
                self._reset(view, view.boot_id, f"{len(view.blocks)} blocks, over {view.max_blocks}")
                return
        view.complete = batch.complete
        view.next_seq = batch.seq + 1

    def forget(self, worker_id: str) -> None:
        view = self._views.pop(worker_id, None)
        if view is not None:
            self._clear(view)
            self._by_scheme = None

    def _reset(self, view: EngineView, boot_id: str | None, why: str) -> None:
        if view.synced:
            log.info("KV view of %s dropped until its next snapshot: %s", view.worker_id, why)
        self._clear(view)
        view.boot_id = boot_id
        view.synced = view.complete = False
        view.resyncs += 1
        self._by_scheme = None

    def _add(self, view: EngineView, hashes: Iterable[int]) -> None:
        # set and dict operations in C for the blocks one worker holds alone; a Python loop only for shared ones
        new = set(hashes)
        new -= view.blocks
        if not new:
            return
        view.blocks |= new
        single, shared, wid = self._single, self._shared, view.worker_id
        in_shared = new & shared.keys()
        in_single = new & single.keys()
        for h in in_shared:
            shared[h].add(wid)
        for h in in_single:
            shared[h] = {single.pop(h), wid}
        if in_shared or in_single:
            new -= in_shared
            new -= in_single
        single.update(dict.fromkeys(new, wid))

    def _remove(self, view: EngineView, hashes: Iterable[int]) -> None:
        gone = view.blocks.intersection(hashes)
        if not gone:
            return
        view.blocks -= gone
        single, shared, wid = self._single, self._shared, view.worker_id
        in_shared = gone & shared.keys()
        for h in in_shared:
            holders = shared[h]
            holders.discard(wid)
            if len(holders) == 1:
                single[h] = holders.pop()
                del shared[h]
        if in_shared:
            gone -= in_shared
        deque(map(single.pop, gone), maxlen=0)

    def _clear(self, view: EngineView) -> None:
        self._remove(view, view.blocks.copy())

    # --- questions ----------------------------------------------------------------------------
    def view(self, worker_id: str) -> EngineView | None:
        return self._views.get(worker_id)

    def views(self) -> list[EngineView]:
        return list(self._views.values())

    def exact_by_scheme(self) -> dict[HashScheme, frozenset[str]]:
        """The workers whose views routing may trust now, by how their engines name blocks (kept between
        changes: a decision reads it without visiting every worker)."""
        if self._by_scheme is None:
            by_scheme: dict[HashScheme, set[str]] = {}
            for view in self._views.values():
                if view.exact:
                    assert view.scheme is not None
                    by_scheme.setdefault(view.scheme, set()).add(view.worker_id)
            self._by_scheme = {scheme: frozenset(ids) for scheme, ids in by_scheme.items()}
        return self._by_scheme

    def match(self, hashes: Sequence[int], worker_ids: Collection[str] | None = None) -> dict[str, int]:
        """For each worker (among `worker_ids`; None: any) holding the first block, how many leading blocks of
        `hashes` its engine holds. Engines evict any block, not only a prompt's tail, so this walks the chain
        to each holder's first miss (as vLLM's own lookup stops there) instead of bisecting."""
        depth: dict[str, int] = {}
        if not hashes:
            return depth
        single, shared = self._single, self._shared
        held: str | set[str] | None = single.get(hashes[0]) or shared.get(hashes[0])
        if held is None:
            return depth
        current = {held} if isinstance(held, str) else set(held)
        if worker_ids is not None:
            current.intersection_update(worker_ids)
        last: object = held
        i = 1
        n = len(hashes)
        while current and i < n:
            h = hashes[i]
            held = single.get(h) or shared.get(h)
            if held is None:
                break
            if held is not last and held != last:  # the same holders as the block before: nothing changes
                last = held
                if isinstance(held, str):
                    if held in current:
                        gone = current - {held}
                        current = {held}
                    else:
                        gone, current = current, set()
                else:
                    gone = current - held
                    current &= held
                for wid in gone:
                    depth[wid] = i
            i += 1
        for wid in current:
            depth[wid] = i
        return depth

    def stats(self) -> dict[str, Any]:
        """For /metrics and tests: blocks indexed, views by state."""
        views = self._views.values()
        return {"blocks": len(self), "views": len(self._views),
                "exact": sum(1 for v in views if v.exact), "awaiting": sum(1 for v in views if not v.synced),
                "resyncs": sum(v.resyncs for v in views)}
