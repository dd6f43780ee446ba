"""The worker's copy of its engine's cached blocks, and the batches that tell the proxy how it changes.

Owns the blocks the engine's KV events say it holds (with copies: vLLM may cache one hash in two blocks and
evicts them one at a time), the changes not yet sent, netted per block (stored then evicted within a report
interval is no change), and when to send everything instead (a snapshot). It does not read events
(backends/kv_subscriber.py feeds it) nor send anything (backends/reporter.py takes its batches).

Bounded: the copy holds at most what the engine can (its capacity in blocks, with slack), the pending
changes at most MAX_PENDING blocks; past either, it falls back to a snapshot instead of growing, and a copy
that outgrew the engine (removals were missed) is dropped and marked incomplete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from proxy.kvevents import MAX_BATCH_BLOCKS, KvEventBatch, pack_hashes

log = logging.getLogger("kvroute.kv_mirror")

# Changes kept between two reports; past this the next batch is a snapshot (never larger than the cache).
MAX_PENDING = 65536
# Without an engine capacity to go by, the copy holds at most this many blocks.
DEFAULT_MAX_BLOCKS = 1 << 20
CAPACITY_SLACK = 1.25
# A snapshot goes out at least this often: proxy replicas that lost a message on the way (state: redis) are
# exact again within this time; on one proxy it costs one batch of the cache's size a minute.
SNAPSHOT_EVERY_S = 60.0


class KvMirror:
    """Fed with the engine's events; `take_batch()` once per load report."""

    def __init__(self, hash_algo: str, hash_seed: str, block_size: int | None = None,
                 capacity_blocks: int | None = None, snapshot_every_s: float = SNAPSHOT_EVERY_S) -> None:
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.snapshot_every_s = snapshot_every_s
        self._copies: dict[int, int] = {}  # block hash -> blocks of the engine holding it
        self._before: dict[int, bool] = {}  # changed since the last batch -> was it held then
        self._cleared = False  # the engine cleared its cache since the last batch
        self._snapshot_due = True  # the first batch of every boot is a snapshot
        self._last_snapshot = 0.0
        self.complete = True  # False: events were lost and could not be replayed
        self._seq = 0
        self.stats = {"stored": 0, "removed": 0, "cleared": 0, "batches": 0, "snapshots": 0, "lost": 0}

    def __len__(self) -> int:
        return len(self._copies)

    @property
    def max_blocks(self) -> int:
        if self.capacity_blocks is None:
            return DEFAULT_MAX_BLOCKS
        return min(DEFAULT_MAX_BLOCKS, int(self.capacity_blocks * CAPACITY_SLACK) + 64)

    # --- the engine's side ----------------------------------------------------------------------
    def learn_block_size(self, block_size: int) -> None:
        """The engine's block size, from its first event or its metrics: the proxy needs it to match prompts."""
        if block_size and self.block_size is None:
            self.block_size = block_size
            self._snapshot_due = True

    def stored(self, hashes: Iterable[int], block_size: int | None = None) -> None:
        if block_size:
            self.learn_block_size(block_size)
        copies, before = self._copies, self._before
        for h in hashes:
            held = copies.get(h, 0)
            if not held and h not in before:
                before[h] = False
            copies[h] = held + 1
            self.stats["stored"] += 1
        if len(copies) > self.max_blocks:
            log.warning("the engine's KV events name %d blocks, more than it holds (%d): removals were missed",
                        len(copies), self.max_blocks)
            self.lost()
        self._bound_pending()

    def removed(self, hashes: Iterable[int]) -> None:
        copies, before = self._copies, self._before
        for h in hashes:
            held = copies.get(h)
            if held is None:
                continue  # stored before a loss: its removal changes nothing the proxy was told
            if held > 1:
                copies[h] = held - 1
                continue
            del copies[h]
            if h not in before:
                before[h] = True
            self.stats["removed"] += 1
        self._bound_pending()

    def cleared(self) -> None:
        """AllBlocksCleared: the engine holds nothing now, and the copy is exact again."""
        self._copies.clear()
        self._before.clear()
        self._cleared = True
        self.complete = True
        self.stats["cleared"] += 1

    def lost(self) -> None:
        """Events were lost for good: what the engine held before now is unknown; tell the proxy so."""
        self._copies.clear()
        self._before.clear()
        self.complete = False
        self._snapshot_due = True
        self.stats["lost"] += 1

    def _bound_pending(self) -> None:
        if len(self._before) > MAX_PENDING:
            self._before.clear()  # the snapshot says it all
            self._snapshot_due = True

    # --- the proxy's side -----------------------------------------------------------------------
    def resync(self) -> None:
        """Send everything next (the proxy asked, or a report may not have arrived)."""
        self._snapshot_due = True

    def take_batch(self, now: float | None = None) -> KvEventBatch | None:
        """The next batch for a load report; None when there is nothing to tell."""
        now = time.monotonic() if now is None else now
        if self._snapshot_due or now - self._last_snapshot >= self.snapshot_every_s:
            return self._snapshot(now)
        if not self._before and not self._cleared:
            return None
        copies = self._copies
        stored = [h for h, held in self._before.items() if not held and h in copies]
        removed = [h for h, held in self._before.items() if held and h not in copies]
        cleared, self._cleared = self._cleared, False
        self._before.clear()
        if not stored and not removed and not cleared:
            return None
        self._seq += 1
        self.stats["batches"] += 1
        return KvEventBatch(seq=self._seq, cleared=cleared, complete=self.complete,
                            stored=pack_hashes(stored), removed=pack_hashes(removed))

    def _snapshot(self, now: float) -> KvEventBatch:
        self._snapshot_due = self._cleared = False
        self._before.clear()
        self._last_snapshot = now
        self._seq += 1
        self.stats["snapshots"] += 1
        held = list(self._copies)
        complete = self.complete
        if len(held) > MAX_BATCH_BLOCKS:
            held, complete = held[:MAX_BATCH_BLOCKS], False
        return KvEventBatch(seq=self._seq, snapshot=True, complete=complete, stored=pack_hashes(held),
                            block_size=self.block_size, hash_algo=self.hash_algo, hash_seed=self.hash_seed,
                            capacity_blocks=self.capacity_blocks)
