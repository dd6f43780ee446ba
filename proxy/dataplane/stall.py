"""Stalled workers: a worker that holds requests is stalled only when its engine shows no progress AND does not
answer a probe; it then gets no new work and everything it holds moves elsewhere.

Owns the rule and its timing, one lazily re-armed timer and at most one probe per busy worker:
1. Quiet: nothing arrived on any of its connections and its engine's progress mark (loadview.py: the work
   counters and KV usage its reports or scrapes carry) did not move for T, the longest silence a healthy
   engine plausibly keeps while holding what it holds:
       T = SLACK x (decode step + max(prefill backlog, step budget) x prefill s/token), in [stall_min_s, idle_s]
   from the estimator's learnt step times (or the streams' own gap, if longer) and the prompt tokens sent there
   that have no output yet. A stream paused by its own slow client is our silence, not the worker's.
2. Then one probe of its engine (proxy/workers/engine_probe.py), allowed max(T, PROBE_MIN_S): an answer, or bytes or
   progress meanwhile, is life (look again T later); no answer is a stall,
3. unless no other worker of its model is routable: the last one is never failed, its requests wait under
   their own deadlines (first_byte_s, idle_s, total_s).
A busy engine whose counters move is never stalled, however long its streams are silent. A worker marked
stalled is taken back at its next report, or a probe or scrape that shows its engine moved (registry.py).
What a stalled exchange does (retry, migrate) is exchange.py's and journey.py's, told through Watched. The
derivation: docs/design/liveness.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from proxy.config import Timeouts
from proxy.workers.loadview import STEP_TOKENS_ASSUMED
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.dataplane")

GAP_WEIGHT = 0.1        # EWMA weight of one new inter-chunk gap
SLACK = 3.0             # T is this many plausible steps: a loaded host stretches a step, three rarely
PROBE_MIN_S = 3.0       # the least a probe is given to answer (a busy engine's API server answers late)
RECHECK_S = 0.25        # while every stream is paused by its client


class Watched(Protocol):
    """What a pulse needs of an exchange it watches (exchange.py's Exchange)."""

    streaming: bool  # relaying a stream: bytes are expected steadily
    paused: bool     # reading paused because its client reads slowly

    def worker_stalled(self, detail: str) -> None: ...


class StepModel(Protocol):
    """A worker's learnt step times (proxy/routing/estimator.py's WorkerModel), in wall seconds."""

    @property
    def decode_step_s(self) -> float: ...

    @property
    def s_per_token(self) -> float: ...


# Ask a worker's engine whether it is alive, within `timeout_s`: True when it answered (engine_probe.py).
EngineProbe = Callable[[Worker, float], Awaitable[bool]]


class Pulse:
    """One worker's liveness while it holds requests: the last byte on any of its connections, and the rule."""

    __slots__ = ("worker", "exchanges", "last_byte", "gap", "streams", "timer", "loop", "watch", "probing")

    def __init__(self, worker: Worker, loop: asyncio.AbstractEventLoop, watch: StallWatch) -> None:
        self.worker = worker
        self.loop = loop
        self.watch = watch
        self.exchanges: set[Watched] = set()
        self.last_byte = loop.time()
        self.gap = 0.0            # EWMA of a stream's inter-chunk gap, seconds
        self.streams = 0          # exchanges relaying a stream (exchange.py counts them)
        self.timer: asyncio.TimerHandle | None = None
        self.probing = False

    def threshold(self) -> float:
        """T: the longest silence this worker's engine plausibly keeps now (see the module docstring)."""
        timeouts = self.watch.timeouts()
        model = self.watch.step_model(self.worker.worker_id)
        load = self.worker.load
        step_tokens = load.step_tokens or STEP_TOKENS_ASSUMED
        plausible = max(model.decode_step_s, self.gap) + max(load.prefill_backlog, step_tokens) * model.s_per_token
        return min(max(timeouts.stall_min_s, SLACK * plausible), timeouts.idle_s)

    def quiet_since(self) -> float:
        """The last sign of life: a byte from the worker, or its engine's progress mark moving."""
        progress_at = self.worker.load.progress_at
        return self.last_byte if progress_at is None else max(self.last_byte, progress_at)

    def join(self, exchange: Watched) -> None:
        if not self.exchanges:
            self.last_byte = self.loop.time()  # silence counts only while it holds requests
        self.exchanges.add(exchange)
        if self.timer is None and not self.probing:
            self.arm(self.last_byte + self.threshold())

    def leave(self, exchange: Watched) -> None:
        self.exchanges.discard(exchange)
        if not self.exchanges and self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def observe_gap(self, gap: float) -> None:
        self.gap += GAP_WEIGHT * (gap - self.gap)

    def arm(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._check)

    def _check(self) -> None:
        self.timer = None
        if not self.exchanges or self.probing:
            return
        now = self.loop.time()
        threshold = self.threshold()
        if threshold >= self.watch.timeouts().idle_s:  # capped: each exchange's own idle deadline comes as soon
            self.arm(now + threshold)
            return
        quiet_since = self.quiet_since()
        if now - quiet_since < threshold:
            self.arm(quiet_since + threshold)
            return
        if all(e.paused for e in self.exchanges):  # silent by our doing: its clients read slowly
            self.arm(now + RECHECK_S)
            return
        self.probing = True
        self.watch.spawn(self._probe(now - quiet_since, threshold))

    async def _probe(self, quiet_s: float, threshold: float) -> None:
        """Quiet for `quiet_s` >= T: one probe decides (see the module docstring)."""
        signs = (self.last_byte, self.worker.load.progress_at)
        timeout = max(threshold, PROBE_MIN_S)
        try:
            answered = await self.watch.probe(self.worker, timeout)
        finally:
            self.probing = False
        if not self.exchanges:
            return
        if answered or signs != (self.last_byte, self.worker.load.progress_at):
            self.arm(self.loop.time() + threshold)
            return
        self.watch.stalled(self, threshold, f"stalled: nothing for {quiet_s + timeout:.1f}s while holding "
                                            f"{len(self.exchanges)} request(s) ({self.streams} streaming), its "
                                            f"engine's counters still and no answer to a probe within {timeout:.1f}s")


class StallWatch:
    """Pulses of the workers that hold requests; a stalled one is marked in the registry and let go of."""

    def __init__(self, registry: Registry, timeouts: Callable[[], Timeouts], step_model: Callable[[str], StepModel],
                 probe: EngineProbe) -> None:
        self.registry = registry
        self.timeouts = timeouts
        self.step_model = step_model
        self.probe = probe
        self.pulses: dict[str, Pulse] = {}
        self._probes: set[asyncio.Task[None]] = set()

    def pulse(self, worker: Worker) -> Pulse:
        pulse = self.pulses.get(worker.worker_id)
        if pulse is None or pulse.worker is not worker:
            if pulse is not None and not pulse.exchanges:
                del self.pulses[worker.worker_id]
            pulse = Pulse(worker, asyncio.get_running_loop(), self)
            self.pulses[worker.worker_id] = pulse
        return pulse

    def forget_idle(self, pulse: Pulse) -> None:
        if not pulse.exchanges and not pulse.probing and self.pulses.get(pulse.worker.worker_id) is pulse:
            del self.pulses[pulse.worker.worker_id]

    def spawn(self, probe: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(probe)
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def stalled(self, pulse: Pulse, threshold: float, detail: str) -> None:
        """`pulse`'s worker failed the rule: mark it and move what it holds, unless it is the last of its model."""
        worker = pulse.worker
        alone = [m for m in worker.models if not self.registry.candidates(m, exclude=(worker.worker_id,))]
        if alone:
            log.warning("worker %s looks %s, but no other worker serves %s: its requests wait under their own "
                        "timeouts", worker.worker_id, detail, ", ".join(alone))
            pulse.arm(pulse.loop.time() + threshold)
            return
        log.warning("worker %s %s; moving its requests", worker.worker_id, detail)
        self.registry.mark_stalled(worker, detail)
        for exchange in list(pulse.exchanges):
            exchange.worker_stalled(detail)  # closes the upstream connection: the worker sees the cancel
        pulse.exchanges.clear()
        self.forget_idle(pulse)
