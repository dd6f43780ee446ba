"""The sim engine's loop: runs the scheduler step by step in simulated time and delivers tokens.

Owns the clock (simulated seconds = wall seconds x time scale, with each step taking exactly
cost.py's step time), request submission/abort, and per-request token queues. It does not parse
HTTP (server.py) or decide batches (scheduler.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from backends.sim.cost import step_time_s
from backends.sim.kvcache import KVCache
from backends.sim.presets import Preset
from backends.sim.scheduler import RequestStatus, Scheduler, SimRequest, TokenEvent
from backends.sim.speed import StepSpeed

log = logging.getLogger("kvroute.sim.engine")

MIN_SLEEP_S = 0.001
LAG_WARN_EVERY_S = 30.0
# a back-to-back step may start on the simulated clock even when the loop woke this late (wall seconds):
# timer ticks and writing the last step's tokens make every wake-up ~0.5-1 ms late, and without this
# slack those delays would add up step after step (~10% of a 5 ms step) instead of being caught up
CATCH_UP_WALL_S = 0.003


class RemoteKvHooks(Protocol):
    """The decode side of a KV hand-over (backends/sim/transfer.py): told when a request is parked with its blocks
    (pull now) and when one is dropped before that (let the prefill worker free its blocks)."""

    def parked(self, request: SimRequest) -> None: ...

    def abandoned(self, request: SimRequest) -> None: ...


class SimEngine:
    """A simulated vLLM engine: continuous batching over a paged KV cache, in simulated time.

    Time: `now()` is wall time since start times `time_scale`. A step that starts at simulated
    time t ends at t + step_time, and the loop sleeps until the wall clock reaches it. The next
    step starts where the last one ended (never before a request it admits arrived) as long as the
    loop is less than CATCH_UP_WALL_S late; when the host falls further behind, simulated time
    follows the wall clock and the difference counts as lag (steps never overlap).
    """

    def __init__(self, preset: Preset, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.preset = preset
        self.time_scale = time_scale
        num_blocks = max(1, preset.kv_capacity_tokens // preset.block_size)
        self.kv = KVCache(num_blocks, preset.block_size)
        self.scheduler = Scheduler(self.kv, preset.max_num_seqs, preset.max_num_batched_tokens)
        # a request longer than the whole cache could never run: cap the context at the cache size
        self.max_model_len = min(preset.max_model_len, num_blocks * preset.block_size)
        self.stalled = False
        self.num_steps = 0
        self.busy_sim_s = 0.0
        self.speed = StepSpeed()  # recent prefill rate and decode step time, for the proxy's routing model
        # simulated seconds lost because the host could not keep up between back-to-back steps;
        # benchmarks report it (a large value means the figures are the host's, not the model's)
        self.lag_sim_s = 0.0
        self._lag_warned_at = time.monotonic()
        self._lag_mark = (0.0, 0.0)  # (busy, lag) at the last check
        self.finish_listeners: list[Callable[[SimRequest], None]] = []
        self.step_listeners: list[Callable[[], None]] = []  # called after each step's tokens are delivered
        self.num_enqueued = 0  # requests that reached the scheduler (past the front end)
        self.remote_kv: RemoteKvHooks | None = None
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._t0 = time.monotonic()
        self._sim_clock = 0.0
        self._frontend_free_at = 0.0  # simulated time the API front end finishes its current request
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- time ----------------------------------------------------------------------------------
    def now(self) -> float:
        """Simulated seconds since the engine started."""
        return (time.monotonic() - self._t0) * self.time_scale

    async def _sleep_until(self, sim_t: float) -> None:
        delay = (sim_t - self.now()) / self.time_scale
        # uvloop's timers tick in whole milliseconds: a shorter sleep would last ~1 ms and make a fast
        # time scale fall behind. Below that we only yield, running at most 1 ms (wall) ahead.
        await asyncio.sleep(delay if delay >= MIN_SLEEP_S else 0.0)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-sim-engine")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> asyncio.Queue[TokenEvent]:
        """Queue a request; it reaches the scheduler once the (simulated) API front end is done with it."""
        now = request.arrival_time = self.now()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[request.request_id] = queue
        frontend = self.preset.frontend_s + self.preset.frontend_s_per_prompt_token * request.num_prompt_tokens
        if frontend <= 0:
            self._enqueue(request)
            return queue
        # one front end, first come first served: a request also waits for the ones before it
        ready = self._frontend_free_at = max(self._frontend_free_at, now) + frontend
        asyncio.get_running_loop().call_later((ready - now) / self.time_scale, self._enqueue, request)
        return queue

    def _enqueue(self, request: SimRequest) -> None:
        if request.finished:  # aborted while the front end had it
            return
        self.num_enqueued += 1
        self.scheduler.add(request)
        self._wake.set()

    def abort(self, request: SimRequest) -> None:
        """Stop a request (its client left): it leaves the queues and its blocks are freed."""
        self._queues.pop(request.request_id, None)
        if request.remote_kv is not None and self.remote_kv is not None \
                and request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            self.remote_kv.abandoned(request)  # never pulled: its prefill worker may free the blocks now
        if not request.finished:
            self.scheduler.abort(request)
            log.debug("aborted %s after %d tokens", request.request_id, request.num_output_tokens)

    def kv_arrived(self, request: SimRequest, loaded_tokens: int | None, recompute: bool = False) -> None:
        """A parked request's KV pull ended (None: failed); see Scheduler.kv_arrived."""
        event = self.scheduler.kv_arrived(request, loaded_tokens, recompute)
        if event is not None:
            self._deliver(event)
        self._wake.set()

    def release_blocks(self, request_id: str) -> None:
        """Free the blocks a finished request kept for a transfer (pulled, or its lease ran out)."""
        self.kv.free(request_id)
        self._wake.set()

    def _deliver(self, event: TokenEvent) -> None:
        queue = self._queues.get(event.request.request_id)
        if queue is not None:
            queue.put_nowait(event)
        if event.finished:
            self._queues.pop(event.request.request_id, None)
            for listener in self.finish_listeners:
                listener(event.request)

    def set_stalled(self, stalled: bool) -> None:
        self.stalled = stalled
        self._wake.set()

    def _note_lag(self, lag: float) -> None:
        self.lag_sim_s += lag
        wall = time.monotonic()
        if wall - self._lag_warned_at < LAG_WARN_EVERY_S:
            return
        recent_busy = self.busy_sim_s - self._lag_mark[0]
        recent_lag = self.lag_sim_s - self._lag_mark[1]
        if recent_busy > 0 and recent_lag / recent_busy > 0.2:
            log.warning("the host is not keeping up with --time-scale %g: %.0f%% of simulated time lost in the "
                        "last %.0fs; latencies now reflect the host", self.time_scale,
                        100 * recent_lag / recent_busy, wall - self._lag_warned_at)
        self._lag_warned_at = wall
        self._lag_mark = (self.busy_sim_s, self.lag_sim_s)

    # ---- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        back_to_back = False
        while True:
            if self.stalled or not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                back_to_back = False
                continue
            step = self.scheduler.schedule()
            for request in step.parked:
                if self.remote_kv is not None:
                    self.remote_kv.parked(request)
                else:  # nobody to pull from: compute the prompt here
                    self.scheduler.kv_arrived(request, None, recompute=True)
            if not step.scheduled:  # nothing fits right now; wait for a change instead of spinning
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
                back_to_back = False
                continue
            duration = step_time_s(self.preset, step.work)
            now = self.now()
            if back_to_back and now - self._sim_clock <= CATCH_UP_WALL_S * self.time_scale:
                start = max(self._sim_clock, *(request.arrival_time for request, _ in step.scheduled))
            else:
                start = max(self._sim_clock, now)
            if back_to_back:
                self._note_lag(start - self._sim_clock)
            back_to_back = True
            end = start + duration
            await self._sleep_until(end)
            self._sim_clock = end
            self.num_steps += 1
            self.busy_sim_s += duration
            self.speed.observe(step.work, duration)
            for event in self.scheduler.update(step, now=end):
                self._deliver(event)
            for step_listener in self.step_listeners:
                step_listener()
