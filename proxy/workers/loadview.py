"""Each worker's load as routing sees it: the newest reading, corrected by what was dispatched since.

Owns the arithmetic (projected KV usage, queue depth); it does no I/O (proxy/workers/monitor.py scrapes and
proxy/workers/engine_metrics.py reads what it scrapes) and knows nothing about worker states.

    projected_kv_usage = reading.kv_usage + pending_tokens / capacity_tokens
    queue_depth        = reading.num_waiting + pending_requests

`pending` are requests dispatched to the worker too recently to be in its newest reading and
still in flight (est. prompt tokens + expected generated tokens each). A reading taken at
least `dispatch_visible_after_s` after a dispatch is assumed to include it; a request that has
finished no longer holds KV or a queue slot, so it stops counting at once. A worker with no reading
at all (not reporting, /metrics unreadable) falls back to the proxy's own in-flight counts. Those
times and when an engine that reported no queue may be queueing (engine_backlog) are admission's rules,
config.yaml's `proxy.routing.admission` (routing_config.AdmissionConfig): each load holds the proxy's.

Watchers (proxy/routing/candidates.py keeps its load order with them) are called after every event
that changes these numbers; the only change time makes on its own is forgetting pending dispatches
`dispatch_forget_after_s` old, which happens when a view is asked for or forget_before() is called.

Progress: each reading's progress mark (the engine's work counters and KV usage) is compared with the last
one; `progress_at` is when it last moved, what the stall rule (proxy/dataplane/stall.py) and the circuit
breaker's blame (proxy/dataplane/record.py) ask.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from proxy.routing_config import AdmissionConfig

# The engine step budget `confirm_above_prefill_tokens` is stated at: vLLM's default token budget per step for an
# API server on an H100-class GPU (the sim presets' too); scaled by the engine's own budget where its worker reports
# one (LoadReport.max_num_batched_tokens).
STEP_TOKENS_ASSUMED = 8192
# KV size assumed for a worker that never said (LMDeploy /nodes/add without a report).
DEFAULT_CAPACITY_TOKENS = 32768


class Dispatch:
    """One request sent to a worker: its KV and prefill estimates, and whether it still counts as pending."""

    __slots__ = ("at", "kv_tokens", "prefill_tokens", "pending", "prefilling", "unconfirmed")

    def __init__(self, at: float, kv_tokens: int, prefill_tokens: int = 0) -> None:
        self.at = at
        self.kv_tokens = kv_tokens
        self.prefill_tokens = prefill_tokens
        self.pending = True
        self.prefilling = True  # no output seen yet: its prompt is still ahead in the engine's prefill work
        self.unconfirmed = True  # nothing yet shows the engine took it in (see admit_after_output / _head)


@dataclass(slots=True)
class EngineReading:
    """One measurement of a worker's own load (a report or a /metrics scrape)."""

    kv_usage: float
    num_running: int
    num_waiting: int
    capacity_tokens: int | None = None
    prefix_cache_hit_rate: float = 0.0
    # the engine's cumulative work counters (vLLM's names; None: the engine has none)
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    preemptions_total: float | None = None

    def progress_mark(self) -> tuple[float | None, ...]:
        """What changes only when the engine works: its work counters and its KV usage (a prefill chunk takes
        blocks before any counter moves). Queue lengths are left out: an arrival changes them with no work done."""
        return (self.prompt_tokens_total, self.generation_tokens_total, self.preemptions_total, self.kv_usage)


class WorkerLoad:
    """Load bookkeeping for one worker; cheap enough to consult on every routing decision."""

    __slots__ = ("_capacity", "reading", "reading_at", "reading_source", "_pending", "_pending_tokens",
                 "_pending_count", "_pending_prefill", "in_flight", "in_flight_tokens", "dispatched_total",
                 "finished_since_reading", "version", "_snapshot", "_snapshot_version", "watchers",
                 "prefill_backlog", "_pending_unconfirmed", "step_tokens", "rules", "forget_after_s", "_visible_after_s",
                 "_confirms", "_confirms_by_head", "_confirm_above_kv", "_confirm_above_prefill", "outputting",
                 "progress_at", "_progress_mark")

    def __init__(self, capacity_tokens: int | None = None, rules: AdmissionConfig | None = None) -> None:
        self._capacity = capacity_tokens or DEFAULT_CAPACITY_TOKENS
        self._take(rules or AdmissionConfig())  # the proxy's admission rules (admission.py gives them)
        # bumped on every event that changes what snapshot() returns (reading, dispatch, finish, forget)
        self.version = 0
        self._snapshot: LoadSnapshot | None = None
        self._snapshot_version = -1
        self.reading: EngineReading | None = None
        self.reading_at: float | None = None
        self.reading_source: str | None = None
        self._pending: deque[Dispatch] = deque()
        self._pending_tokens = 0
        self._pending_count = 0
        self._pending_prefill = 0
        self._pending_unconfirmed = 0  # pending dispatches nothing has confirmed the engine took in
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.outputting = 0  # requests in flight here that produced output: the engine runs them (trust.py)
        self.dispatched_total = 0
        # requests finished since the newest reading: each one let the engine admit one of the
        # requests it reported waiting (or was one of them, if it was sent just before the reading)
        self.finished_since_reading = 0
        # prompt tokens to prefill of the requests in flight here that have not produced output yet: the proxy's
        # own exact count (no report lag) of the prefill work a request sent now would queue behind
        self.prefill_backlog = 0
        # the engine's token budget per scheduler step, when its worker says (None: STEP_TOKENS_ASSUMED)
        self.step_tokens: int | None = None
        # called as watcher.load_changed(self) after each event that changes the views below
        self.watchers: tuple[LoadWatcher, ...] = ()
        # when a reading last showed the engine's progress mark moved (EngineReading.progress_mark); None: never
        self.progress_at: float | None = None
        self._progress_mark: tuple[float | None, ...] | None = None

    def set_rules(self, rules: AdmissionConfig) -> None:
        """New admission rules (a config edit): the views change at once, and the watchers hear of it."""
        if rules != self.rules:
            self._take(rules)
            self.version += 1
            if self.watchers:
                self._changed()

    def _take(self, rules: AdmissionConfig) -> None:
        # copied into slots: read on every load event and view, where a pydantic model's attribute costs ~3x
        self.rules = rules
        self.forget_after_s = rules.dispatch_forget_after_s
        self._visible_after_s = rules.dispatch_visible_after_s
        self._confirms = rules.admit_after_output or rules.admit_after_head
        self._confirms_by_head = rules.admit_after_head
        self._confirm_above_kv = rules.confirm_above_kv_usage
        self._confirm_above_prefill = rules.confirm_above_prefill_tokens

    def watch(self, watcher: LoadWatcher) -> None:
        if watcher not in self.watchers:
            self.watchers = (*self.watchers, watcher)

    def unwatch(self, watcher: LoadWatcher) -> None:
        self.watchers = tuple(w for w in self.watchers if w is not watcher)

    def _changed(self) -> None:
        for watcher in self.watchers:
            watcher.load_changed(self)

    @property
    def capacity_tokens(self) -> int:
        return self._capacity

    @capacity_tokens.setter
    def capacity_tokens(self, value: int) -> None:
        self._capacity = value
        self.version += 1
        if self.watchers:
            self._changed()

    # --- events -------------------------------------------------------------------------
    def record_reading(self, reading: EngineReading, now: float, source: str) -> None:
        self.note_progress(reading, now)
        self.version += 1
        self.reading = reading
        self.reading_at = now
        self.reading_source = source
        if reading.capacity_tokens:
            self._capacity = reading.capacity_tokens
        self.finished_since_reading = 0
        self._forget_before(now - self._visible_after_s, notify=False)
        if self.watchers:
            self._changed()

    def note_progress(self, reading: EngineReading, now: float) -> bool:
        """Compare `reading`'s progress mark with the last one seen (a report's or a probe's); True when it moved."""
        mark = reading.progress_mark()
        moved = self._progress_mark is not None and mark != self._progress_mark
        self._progress_mark = mark
        if moved:
            self.progress_at = now
        return moved

    def progressed_since(self, since: float) -> bool:
        """The engine's progress mark moved after `since` (same clock as the readings')."""
        return self.progress_at is not None and self.progress_at > since

    def start_request(self, kv_tokens: int, now: float, prefill_tokens: int = 0, streamed: bool = True) -> Dispatch:
        """A request was sent to this worker; hand the result to finish_request exactly once.

        `streamed=False`: its first output arrives only with its whole answer, so waiting for it (admit_after_output)
        would hold the queue for every request's full length: it counts as confirmed from the start.
        """
        self.version += 1
        self.in_flight += 1
        self.in_flight_tokens += kv_tokens
        self.dispatched_total += 1
        dispatch = Dispatch(now, kv_tokens, prefill_tokens)
        self._pending.append(dispatch)
        self._pending_tokens += kv_tokens
        self._pending_count += 1
        self._pending_prefill += prefill_tokens
        if streamed:
            self._pending_unconfirmed += 1
        else:
            dispatch.unconfirmed = False
        self.prefill_backlog += prefill_tokens
        if self.watchers:
            self._changed()
        return dispatch

    def first_output(self, dispatch: Dispatch) -> None:
        """The request's first generated output came back: its prefill is behind the engine."""
        self._confirm(dispatch)
        if dispatch.prefilling:
            dispatch.prefilling = False
            self.outputting += 1
            self.prefill_backlog -= dispatch.prefill_tokens
            self.version += 1
            if self.watchers:
                self._changed()

    def upstream_head(self, dispatch: Dispatch) -> None:
        """The engine answered the request's head: with admit_after_head, it has taken the request in."""
        if self._confirms_by_head and dispatch.unconfirmed:
            self._confirm(dispatch)
            self.version += 1
            if self.watchers:
                self._changed()

    def _confirm(self, dispatch: Dispatch) -> None:
        if dispatch.unconfirmed:
            dispatch.unconfirmed = False
            if dispatch.pending:
                self._pending_unconfirmed -= 1

    def finish_request(self, dispatch: Dispatch) -> None:
        self.version += 1
        self.in_flight -= 1
        self.in_flight_tokens -= dispatch.kv_tokens
        self.finished_since_reading += 1
        self._confirm(dispatch)
        if dispatch.prefilling:
            dispatch.prefilling = False
            self.prefill_backlog -= dispatch.prefill_tokens
        else:
            self.outputting -= 1
        self._uncount(dispatch)
        if self.watchers:
            self._changed()

    # --- views --------------------------------------------------------------------------
    def projected_kv_usage(self, now: float) -> float:
        """KV usage the worker will have once what the proxy already sent it is admitted."""
        if self.reading is None:
            return self.in_flight_tokens / self.capacity_tokens
        self._forget_before(now - self.forget_after_s)
        return self.reading.kv_usage + self._pending_tokens / self.capacity_tokens

    def queue_depth(self, now: float) -> int:
        """Requests waiting at the worker, counting the ones sent since its last reading."""
        if self.reading is None:
            return self.in_flight
        self._forget_before(now - self.forget_after_s)
        return self.reading.num_waiting + self._pending_count

    def held_before(self, cutoff: float) -> tuple[int, int]:
        """(requests, KV tokens) in flight here that were sent at or before `cutoff`: what a reading taken
        since must show (proxy/workers/report_trust.py)."""
        count, tokens = self.in_flight, self.in_flight_tokens
        for dispatch in reversed(self._pending):
            if dispatch.at <= cutoff:
                break
            if dispatch.pending:  # else it finished: in neither count
                count -= 1
                tokens -= dispatch.kv_tokens
        return count, tokens

    def pending_requests(self) -> int:
        return self._pending_count

    def pending_kv_tokens(self, now: float) -> int:
        """KV tokens of requests sent since the newest reading (or in flight, without a reading)."""
        if self.reading is None:
            return self.in_flight_tokens
        self._forget_before(now - self.forget_after_s)
        return self._pending_tokens

    def pending_prefill_tokens(self, now: float) -> int:
        """Prompt tokens to prefill of requests sent since the newest reading (some may be done)."""
        self._forget_before(now - self.forget_after_s)
        return self._pending_prefill

    def oldest_pending_at(self) -> float | None:
        """When the oldest request still counted as pending was sent (the engine has worked since)."""
        return self._pending[0].at if self._pending else None

    def engine_backlog(self, now: float) -> int:
        """Requests the engine is estimated to hold waiting (not yet admitted) now.

        0 while it reported none waiting (it admits what it gets); otherwise its reported waiting,
        plus what was sent since, minus one per request finished since (each frees room for one
        waiter). A worker without a reading is assumed to admit. With admit_after_output (or _head),
        a worker that reported none waiting holds the requests sent since that have no output (or no
        response head) yet, at most as many as were sent since and not balanced by finished ones, while
        its projected KV usage is at least confirm_above_kv_usage or the prompt tokens it has yet to prefill at
        least admit_prefill_tokens(): it may not have taken them in.
        """
        reading = self.reading
        if reading is None or (reading.num_waiting == 0 and not (self._confirms and self._pending_unconfirmed)):
            return 0
        self._forget_before(now - self.forget_after_s)
        return self.backlog_now()

    def backlog_now(self, unconfirmed: bool = True) -> int:
        """engine_backlog() as of the last event, without forgetting (see forget_before); `unconfirmed=False`:
        without counting requests sent since a report of no queue that are not confirmed yet (those may be
        waiting, which is what admission asks; a queueing-time prediction wants what surely waits)."""
        reading = self.reading
        if reading is None:
            return 0
        over = reading.num_waiting + self._pending_count - self.finished_since_reading
        if reading.num_waiting == 0:
            if (not unconfirmed or not self._confirms or not self._pending_unconfirmed
                    or (reading.kv_usage + self._pending_tokens / self._capacity < self._confirm_above_kv
                        and self.prefill_backlog < self.admit_prefill_tokens())):
                return 0
            return max(0, min(self._pending_unconfirmed, over))
        return max(0, over)

    def admit_prefill_tokens(self) -> float:
        """Prompt tokens still to prefill above which requests without output may be waiting (see engine_backlog)."""
        step = self.step_tokens
        return self._confirm_above_prefill * (step / STEP_TOKENS_ASSUMED if step else 1.0)

    def usage_and_queue(self) -> tuple[float, int]:
        """(projected_kv_usage, queue_depth) as of the last event, without forgetting (see forget_before)."""
        reading = self.reading
        if reading is None:
            return self.in_flight_tokens / self._capacity, self.in_flight
        return reading.kv_usage + self._pending_tokens / self._capacity, reading.num_waiting + self._pending_count

    def admits(self) -> bool:
        """engine_backlog() == 0 as of the last event, without forgetting (see forget_before)."""
        return self.backlog_now() == 0

    def forget_before(self, cutoff: float) -> None:
        """Stop counting dispatches sent at or before `cutoff` (what the views do at now - dispatch_forget_after_s)."""
        self._forget_before(cutoff)

    def snapshot(self, now: float) -> LoadSnapshot:
        """Everything routing reads about this load at `now`, in one object (kept until the next event)."""
        pending = self._pending
        if pending and pending[0].at <= now - self.forget_after_s:
            self._forget_before(now - self.forget_after_s)
        if self._snapshot_version == self.version:
            return self._snapshot  # type: ignore[return-value]
        snap = self._snapshot = LoadSnapshot(self)
        self._snapshot_version = self.version
        return snap

    def _uncount(self, dispatch: Dispatch) -> None:
        if dispatch.pending:
            dispatch.pending = False
            self._pending_tokens -= dispatch.kv_tokens
            self._pending_count -= 1
            self._pending_prefill -= dispatch.prefill_tokens
            if dispatch.unconfirmed:
                self._pending_unconfirmed -= 1

    def _forget_before(self, cutoff: float, notify: bool = True) -> None:
        pending = self._pending
        if pending and pending[0].at <= cutoff:
            while pending and pending[0].at <= cutoff:
                self._uncount(pending.popleft())
                self.version += 1
            if notify and self.watchers:
                self._changed()


class LoadWatcher(Protocol):
    def load_changed(self, load: WorkerLoad) -> None: ...


class LoadSnapshot:
    """A WorkerLoad's views after forgetting old dispatches, as plain numbers (see WorkerLoad's methods).

    used: reported KV tokens in use; waiting: reported waiting less those finished since (each let one
    in); running: reported running (in flight without a reading); backlog: engine_backlog(); queued: the same
    without the requests that are only unconfirmed (backlog_now(unconfirmed=False)).
    """

    __slots__ = ("capacity", "used", "waiting", "running", "reported_waiting", "pending_kv", "pending_prefill",
                 "oldest_pending_at", "backlog", "queued", "projected_kv_usage", "in_flight", "outputting")

    def __init__(self, load: WorkerLoad) -> None:
        capacity = self.capacity = load.capacity_tokens
        reading = load.reading
        self.in_flight = load.in_flight
        self.outputting = load.outputting
        self.pending_prefill = load._pending_prefill
        self.oldest_pending_at = load._pending[0].at if load._pending else None
        if reading is None:
            self.used, self.waiting, self.running, self.reported_waiting = 0.0, 0, load.in_flight, 0
            self.pending_kv = load.in_flight_tokens
            self.backlog = self.queued = 0
            self.projected_kv_usage = load.in_flight_tokens / capacity
            return
        self.used = reading.kv_usage * capacity
        self.waiting = max(0, reading.num_waiting - load.finished_since_reading)
        self.running = reading.num_running
        self.reported_waiting = reading.num_waiting
        self.pending_kv = load._pending_tokens
        self.backlog = load.backlog_now()
        self.queued = load.backlog_now(unconfirmed=False)
        self.projected_kv_usage = reading.kv_usage + load._pending_tokens / capacity
