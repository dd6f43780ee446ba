"""Candidate sets for one decision, kept between decisions: a model's workers that fit, ordered by load.

Owns the per-model rosters (the registry's candidates for a model, by the max_model_len a request
needs), their members' load order and how many of them admit at once, all updated from load events;
which worker gets a request stays the policy's, worker states the registry's, holding admission's.

Nothing here is O(fleet) per request. The registry hands out the same candidate list until a
worker's state may change; a Roster mirrors one such list (less the workers too short for the
request: one roster per distinct max_model_len) and keeps, per member, whether its engine admits
(WorkerLoad.admits) and, for the policy that asks (kv_aware), its place in a list sorted by a load
key. Both are updated when the member's load changes (WorkerLoad watchers: report, dispatch,
finish), O(log n) comparisons each. The one change time makes by itself, forgetting dispatches
`dispatch_forget_after_s` old, is kept in a heap of due times and applied by refresh(now) before a
decision reads the roster. A decision then costs O(tried + k): Candidates is the roster less the
workers already tried. Only the rare cases (every fitting worker tried, none fits: 400, stale
fallback) rebuild the list as before.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Iterable, Sequence

from proxy.workers.loadview import WorkerLoad
from proxy.workers.registry import Registry, Worker

# One sorted entry: (rounded load cost, in flight, member seq, member); seq is unique, so the member never compares.
Entry = tuple[float, int, int, "Member"]
LoadCost = Callable[[WorkerLoad], float]
# rosters are kept for at most this many model names at once (as the registry's candidate cache)
MAX_MODELS = 256
# Up to this many candidates, admitting() asks each engine's load directly: as cheap as the count, and
# right even about a reading changed in place without an event (as tests do; the proxy never does).
SCAN_UP_TO = 16
_NO_EXCLUSION: frozenset[str] = frozenset()


class Member:
    """One worker of a roster: whether its engine admits, its order key, when its oldest dispatch expires."""

    __slots__ = ("worker", "load", "seq", "admits", "key", "expiry")

    def __init__(self, worker: Worker, seq: int) -> None:
        self.worker = worker
        self.load = worker.load
        self.seq = seq
        self.admits = False
        self.key: Entry | None = None
        self.expiry: float | None = None  # `at` of the oldest dispatch a heap entry is due for


class Roster:
    """The candidates of one model that fit one context length, kept current by watching their loads."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers  # what policies without a fast path get: the registry's list where it can be
        self.admitting = 0
        self._members: dict[str, Member] = {}
        self._by_load: dict[int, Member] = {}
        self._seq = itertools.count()
        self._ticket = itertools.count()  # heap tie-breaker
        self._expiry: list[tuple[float, int, Member]] = []
        self._cost: LoadCost | None = None
        self._entries: list[Entry] = []
        for worker in workers:
            self._add(worker)

    def __len__(self) -> int:
        return len(self.workers)

    def member(self, worker_id: str) -> Member | None:
        return self._members.get(worker_id)

    # --- membership -------------------------------------------------------------------------
    def sync(self, workers: list[Worker]) -> None:
        """Mirror `workers` now (the same workers in the same order cost one C-level comparison)."""
        if workers is self.workers or workers == self.workers:
            self.workers = workers
            return
        keep = {id(w) for w in workers}
        for member in [m for m in self._members.values() if id(m.worker) not in keep]:
            self._remove(member)
        for worker in workers:
            member = self._members.get(worker.worker_id)
            if member is None or member.worker is not worker:
                if member is not None:
                    self._remove(member)
                self._add(worker)
        self.workers = workers

    def close(self) -> None:
        """Stop watching every member's load (the roster is dropped)."""
        for member in list(self._members.values()):
            self._remove(member)

    def _add(self, worker: Worker) -> None:
        member = Member(worker, next(self._seq))
        self._members[worker.worker_id] = member
        self._by_load[id(member.load)] = member
        member.load.watch(self)
        if self._cost is not None:
            member.key = self._key(member)
            insort(self._entries, member.key)
        self._update(member)

    def _remove(self, member: Member) -> None:
        del self._members[member.worker.worker_id]
        self._by_load.pop(id(member.load), None)
        member.load.unwatch(self)
        if member.admits:
            self.admitting -= 1
        if member.key is not None:
            entries = self._entries
            del entries[bisect_left(entries, member.key)]
            member.key = None
        member.expiry = None  # its heap entries are skipped

    # --- load events ------------------------------------------------------------------------
    def load_changed(self, load: WorkerLoad) -> None:
        member = self._by_load.get(id(load))
        if member is not None:
            self._update(member)

    def _update(self, member: Member) -> None:
        load = member.load
        admits = load.admits()
        if admits is not member.admits:
            member.admits = admits
            self.admitting += 1 if admits else -1
        old = member.key
        if old is not None:
            key = self._key(member)
            if key[0] != old[0] or key[1] != old[1]:
                entries = self._entries
                del entries[bisect_left(entries, old)]
                insort(entries, key)
                member.key = key
        oldest = load.oldest_pending_at()
        if oldest is not None and (member.expiry is None or oldest < member.expiry):
            member.expiry = oldest
            heapq.heappush(self._expiry, (oldest, next(self._ticket), member))

    def refresh(self, now: float) -> None:
        """Apply what time alone changed by `now`: dispatches `dispatch_forget_after_s` old stop counting."""
        heap = self._expiry
        if not heap:
            return
        # the views' own cutoff, computed the same way (every load holds the proxy's one set of rules)
        cutoff = now - heap[0][2].load.forget_after_s
        while heap and heap[0][0] <= cutoff:
            at, _, member = heapq.heappop(heap)
            if member.expiry != at or member.worker.worker_id not in self._members:
                continue  # superseded, or no longer a member
            member.expiry = None
            member.load.forget_before(cutoff)  # its watchers (this roster too) update it if anything changed
            if member.expiry is None:
                self._update(member)

    # --- load order -------------------------------------------------------------------------
    def order(self, cost: LoadCost) -> list[Entry]:
        """Members sorted by (round(cost(load), 9), in flight); read-only, valid until the next load event."""
        if self._cost is not cost:
            self._cost = cost
            for member in self._members.values():
                member.key = self._key(member)
            self._entries = sorted(m.key for m in self._members.values())  # type: ignore[type-var]
        return self._entries

    def _key(self, member: Member) -> Entry:
        load = member.load
        return (round(self._cost(load), 9), load.in_flight, member.seq, member)  # type: ignore[misc]


class Candidates:
    """One decision's candidates: a roster less the workers already tried, or (rare cases) a plain list."""

    __slots__ = ("roster", "excluded", "_workers", "_len")

    def __init__(self, roster: Roster | None, excluded: Collection[str], workers: Sequence[Worker] | None,
                 length: int) -> None:
        self.roster = roster
        self.excluded = excluded  # worker ids of the roster's members that are not candidates
        self._workers = workers
        self._len = length

    @classmethod
    def of(cls, workers: Sequence[Worker]) -> Candidates:
        return cls(None, _NO_EXCLUSION, workers, len(workers))

    @property
    def workers(self) -> Sequence[Worker]:
        """The candidates as a list (the registry's own while nothing is excluded); O(n) only with exclusions."""
        if self._workers is None:
            assert self.roster is not None
            excluded = self.excluded
            self._workers = [w for w in self.roster.workers if w.worker_id not in excluded]
        return self._workers

    def __len__(self) -> int:
        return self._len

    def admitting(self, now: float) -> bool:
        """Whether some candidate's engine admits at once (engine_backlog(now) == 0)."""
        roster = self.roster
        if roster is None or self._len <= SCAN_UP_TO:
            return any(w.load.engine_backlog(now) == 0 for w in self.workers)
        roster.refresh(now)
        count = roster.admitting
        for wid in self.excluded:
            member = roster.member(wid)
            if member is not None and member.admits:
                count -= 1
        return count > 0


class _ModelRosters:
    """The rosters of one model: one per context length a request may need (by distinct max_model_len)."""

    __slots__ = ("base", "lengths", "bounded_only", "rosters")

    def __init__(self, base: list[Worker]) -> None:
        self.base = base
        self.rosters: dict[float, Roster] = {}
        self._measure()

    def _measure(self) -> None:
        self.lengths = sorted({w.max_model_len for w in self.base if w.max_model_len is not None})
        # every worker states a length: a request longer than the largest fits none
        self.bounded_only = all(w.max_model_len is not None for w in self.base)

    def sync(self, base: list[Worker]) -> None:
        self.base = base
        self._measure()
        for threshold, roster in list(self.rosters.items()):
            if threshold == 0 or threshold in self.lengths or threshold == float("inf"):
                roster.sync(self._fitting(threshold))
            else:
                roster.close()
                del self.rosters[threshold]

    def roster_for(self, needed: int) -> Roster | None:
        """The roster of workers whose max_model_len holds `needed` tokens; None when that is none of them."""
        lengths = self.lengths
        if not lengths or needed <= lengths[0]:
            threshold: float = 0
        else:
            i = bisect_left(lengths, needed)
            if i == len(lengths):
                if self.bounded_only:
                    return None
                threshold = float("inf")
            else:
                threshold = lengths[i]
        roster = self.rosters.get(threshold)
        if roster is None:
            roster = self.rosters[threshold] = Roster(self._fitting(threshold))
        return roster

    def _fitting(self, threshold: float) -> list[Worker]:
        if threshold == 0:
            return self.base
        return [w for w in self.base if w.max_model_len is None or w.max_model_len >= threshold]

    def close(self) -> None:
        for roster in self.rosters.values():
            roster.close()
        self.rosters.clear()


class CandidateIndex:
    """Rosters per model over one registry; `find` answers a decision's candidate question in O(tried)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._models: dict[str, _ModelRosters] = {}

    def find(self, model: str, needed: int, tried: Iterable[str]) -> Candidates | None:
        """The ready (else stale) workers of `model` not in `tried` whose max_model_len holds `needed`
        tokens; None where that is empty (or only stale workers are left untried): ask the registry."""
        base = self.registry.candidates(model)
        rosters = self._models.get(model)
        if rosters is None:
            if len(self._models) >= MAX_MODELS:
                self.close()
            rosters = self._models[model] = _ModelRosters(base)
        elif rosters.base is not base:
            rosters.sync(base)
        roster = rosters.roster_for(needed)
        if roster is None or not roster.workers:
            return None
        if not tried:
            return Candidates(roster, _NO_EXCLUSION, roster.workers, len(roster.workers))
        excluded = {wid for wid in tried if wid in roster._members}
        left = len(roster.workers) - len(excluded)
        if left <= 0:
            return None
        return Candidates(roster, excluded, None if excluded else roster.workers, left)

    def close(self) -> None:
        for rosters in self._models.values():
            rosters.close()
        self._models.clear()


def members_in_order(entries: Sequence[Entry]) -> Iterable[Worker]:
    """The workers of a roster's order(), least loaded first (for tests and debugging)."""
    return (entry[3].worker for entry in entries)
