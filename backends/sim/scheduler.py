"""Continuous-batching scheduler of the sim engine, shaped like vLLM v1's.

Owns the waiting and running queues and what each step computes: running requests first
(decode or their next prefill chunk), then waiting ones while `max_num_seqs`,
`max_num_batched_tokens` and free KV blocks allow; preemption by recompute when blocks run out. A step's
full blocks enter the prefix cache when it is scheduled, as in vLLM v1, so requests that share a prefix and are
scheduled together compute it once.
Prefix-cache counters as vLLM's (v1 PrefixCacheStats, 0.32): a request's first admission counts in
prefix_queries/hit_tokens (vllm:prefix_cache_queries / _hits); the re-admission of a preempted one, which
finds most of its own blocks still cached, counts apart (preempted_queries/hit_tokens), so a router whose
engines preempt more does not show a higher hit rate for it.
It does not keep time or talk HTTP (engine.py does); blocks are kvcache.py's.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from backends.sim.cost import StepWork
from backends.sim.kvcache import KVCache, hash_block
from backends.sim.tokens import FillerText, Prompt


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, the prompt's KV being pulled (decode role)
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    """One generation request as the scheduler tracks it."""

    request_id: str
    prompt: Prompt
    max_tokens: int
    arrival_time: float = 0.0
    seed: int = 0
    finish_reason: str = "length"  # reported when max_tokens is reached
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    first_token_time: float | None = None
    finish_time: float | None = None
    # disaggregated serving (backends/sim/transfer.py, encoder.py): keep the blocks for a decode worker to pull
    # once finished; the prefill worker's kv_transfer_params to pull the prompt's KV from; the media spans whose
    # encoder output came from an encode worker (no vision work here); a failed KV load (answered as an error)
    hold_kv: bool = False
    remote_kv: dict[str, Any] | None = None
    encoded_media: frozenset[int] = frozenset()
    failed: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt.token_ids)
        self.filler = FillerText(self.seed)
        self._block_hashes: list[int] = []

    def full_block_hashes(self, block_size: int) -> list[int]:
        """Hash chain over the request's full blocks, extended as tokens are added (computed once)."""
        hashes = self._block_hashes
        for i in range(len(hashes), len(self.token_ids) // block_size):
            hashes.append(hash_block(hashes[-1] if hashes else None, self.token_ids[i * block_size:(i + 1) * block_size]))
        return hashes

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass
class ScheduledStep:
    """The plan of one step: who computes how many tokens, and the work that costs."""

    scheduled: list[tuple[SimRequest, int]]
    work: StepWork
    preempted: list[SimRequest]
    parked: list[SimRequest] = field(default_factory=list)  # admitted to wait for their remote KV


@dataclass
class TokenEvent:
    """One generated token (or the end) for one request."""

    request: SimRequest
    text: str
    finished: bool


@dataclass
class PreemptionRecord:
    """Why a preemption happened: the blocks asked for and the blocks that were free."""

    victim_id: str
    blocks_needed: int
    blocks_free: int


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.awaiting_kv: list[SimRequest] = []  # WAITING_FOR_REMOTE_KV: hold blocks, no batch slot
        self.num_preemptions = 0
        self.preemption_log: deque[PreemptionRecord] = deque(maxlen=1000)
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0
        self.preempted_queries_tokens = 0  # re-admissions after preemption (not in the two above, as vLLM)
        self.preempted_hit_tokens = 0
        self.recent_prefix: deque[tuple[int, int]] = deque(maxlen=256)  # (queries, hits) per admission
        self.num_finished = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # prompts whose prefill completed, counted then (vLLM's vllm:prompt_tokens)

    # ---- queue management ----------------------------------------------------------------------
    def add(self, request: SimRequest) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> None:
        """Drop a request wherever it is and free its blocks (client went away)."""
        if request.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.awaiting_kv.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request.request_id)
        request.status = RequestStatus.ABORTED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not in the batch: queued, and parked for their remote KV (vLLM counts both waiting)."""
        return len(self.waiting) + len(self.awaiting_kv)

    def kv_arrived(self, request: SimRequest, loaded_tokens: int | None, recompute: bool) -> TokenEvent | None:
        """The pull of a parked request's KV ended: `loaded_tokens` came (None: it failed). It joins the batch
        with its prompt computed but the last token (whose logits give the first output, as vLLM recomputes it);
        after a failure it computes what is missing itself (`recompute`), or ends with an error (the event)."""
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return None  # aborted meanwhile
        self.awaiting_kv.remove(request)
        request.remote_kv = None
        if loaded_tokens is None and not recompute:
            self.kv.free(request.request_id)
            request.status, request.failed = RequestStatus.FINISHED, True
            return TokenEvent(request, "", True)
        if loaded_tokens:
            request.num_computed_tokens = min(request.num_computed_tokens + loaded_tokens, request.num_tokens - 1)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return None

    @property
    def recent_prefix_hit_rate(self) -> float:
        queries = sum(q for q, _ in self.recent_prefix)
        return sum(h for _, h in self.recent_prefix) / queries if queries else 0.0

    # ---- one step ------------------------------------------------------------------------------
    def _preempt(self, victim: SimRequest, blocks_needed: int) -> None:
        self.preemption_log.append(PreemptionRecord(victim.request_id, blocks_needed, self.kv.num_free_blocks))
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0  # recompute: its KV is gone (prefix cache may still hold it)
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _allocate_or_preempt(self, request: SimRequest, num_new: int, preempted: list[SimRequest]) -> bool:
        """Room for a running request's next tokens, preempting from the back of the running list
        (the most recently admitted first, as in vLLM) until it fits. False: it preempted itself."""
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new):
            needed = (self.kv.blocks_needed(request.num_computed_tokens + num_new)
                      - len(self.kv.blocks_of(request.request_id)))
            victim = self.running.pop()
            self._preempt(victim, needed)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def schedule(self) -> ScheduledStep:
        """Plan one step: running requests first (decode or next prefill chunk), then admissions."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted: list[SimRequest] = []
        parked: list[SimRequest] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request preempted itself: nothing after it can run either
            scheduled.append((request, num_new))
            self._cache_scheduled(request, num_new)
            budget -= num_new
            index += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hits = self.kv.find_cached_prefix(request.token_ids,
                                                  request.full_block_hashes(self.kv.block_size))
                num_cached = len(hits) * self.kv.block_size
                remote = request.remote_kv is not None
                # a request whose prompt KV comes from a prefill worker takes blocks for all of it now, and no
                # compute: the pull runs beside the batch (backends/sim/transfer.py)
                num_new = request.num_tokens - num_cached if remote else min(request.num_tokens - num_cached, budget)
                if not self.kv.allocate_slots(request.request_id, num_cached, num_new, hits):
                    break  # first come first served: the head waits for room
                self.waiting.popleft()
                request.num_computed_tokens = num_cached
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_cached
                    self.prefix_queries_tokens += request.num_tokens
                    self.prefix_hit_tokens += num_cached
                    self.recent_prefix.append((request.num_tokens, num_cached))
                else:
                    self.preempted_queries_tokens += request.num_tokens
                    self.preempted_hit_tokens += num_cached
                if remote:
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                    self.awaiting_kv.append(request)
                    parked.append(request)
                    continue
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled.append((request, num_new))
                self._cache_scheduled(request, num_new)
                budget -= num_new

        return ScheduledStep(scheduled, self._work_of(scheduled), preempted, parked)

    def _cache_scheduled(self, request: SimRequest, num_new: int) -> None:
        """vLLM v1 puts the full blocks a step will compute in the prefix cache when it schedules them
        (KVCacheManager.allocate_slots): a request scheduled after it, in this step or later, reuses them instead
        of computing them again. Only the request's tokens so far: never an output token not yet sampled."""
        self.kv.cache_full_blocks(request.request_id, request.token_ids,
                                  min(request.num_computed_tokens + num_new, request.num_tokens))

    @staticmethod
    def _work_of(scheduled: list[tuple[SimRequest, int]]) -> StepWork:
        prefill_tokens = decode_seqs = prefill_seqs = kv_read = pairs = image_tokens = 0
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            is_decode = num_new == 1 and request.num_output_tokens > 0 and start == request.num_tokens - 1
            if is_decode:
                decode_seqs += 1
            else:
                prefill_seqs += 1
                prefill_tokens += num_new
            kv_read += start + num_new
            pairs += num_new * start + num_new * (num_new + 1) // 2
            for index, (span_start, length) in enumerate(request.prompt.media_spans):
                if index in request.encoded_media:
                    continue  # an encode worker ran the vision tower; its output came with the request
                overlap = min(start + num_new, span_start + length) - max(start, span_start)
                image_tokens += max(overlap, 0)
        return StepWork(prefill_tokens=prefill_tokens, decode_seqs=decode_seqs, prefill_seqs=prefill_seqs,
                        kv_tokens_read=kv_read, attention_pairs=pairs, image_tokens=image_tokens)

    def update(self, step: ScheduledStep, now: float = 0.0) -> list[TokenEvent]:
        """Apply a finished step: advance computed tokens, sample, finish. Returns the new tokens."""
        events: list[TokenEvent] = []
        for request, num_new in step.scheduled:
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new  # (its blocks entered the prefix cache when scheduled)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no token yet
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
            first = request.num_output_tokens == 0 and not request.prompt.continues
            text, token_id = request.filler.next_piece(first=first)
            request.token_ids.append(token_id)
            request.num_output_tokens += 1
            self.num_generated_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            done = request.num_output_tokens >= request.max_tokens
            if done:
                self.running.remove(request)
                if not request.hold_kv:  # a prefill worker's blocks wait for the decode worker to pull them
                    self.kv.free(request.request_id)
                request.status = RequestStatus.FINISHED
                request.finish_time = now
                self.num_finished += 1
            events.append(TokenEvent(request, text, done))
        return events
