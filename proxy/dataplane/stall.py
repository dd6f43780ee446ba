"""Stalled workers: each worker's pulse (last byte on any of its connections, recent inter-chunk gap) while it
holds requests, and the verdict "stalled" that moves everything it holds elsewhere.

Owns the threshold (max(timeouts.stall_min_s, 20 x the gap's EWMA), at most idle_s) and one lazily re-armed
timer per busy worker; what a stalled exchange does (retry, migrate) is exchange.py's and journey.py's, told
through the Watched protocol.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from proxy.config import Timeouts
from proxy.registry import Registry, Worker

log = logging.getLogger("kvroute.dataplane")

GAP_WEIGHT = 0.1        # EWMA weight of one new inter-chunk gap
STALL_GAPS = 20.0       # silence of this many typical gaps, at least stall_min_s, is a stall
# A worker with no stream under way is stalled only when its load reports stopped as well, for at least
# this long (a long prefill sends nothing for a while, but its worker keeps reporting; a busy host may
# delay a report or two).
REPORTS_LAPSED_S = 5.0
RECHECK_S = 0.25


class Watched(Protocol):
    """What a pulse needs of an exchange it watches (exchange.py's Exchange)."""

    streaming: bool  # relaying a stream: bytes are expected steadily
    paused: bool     # reading paused because its client reads slowly

    def worker_stalled(self, detail: str) -> None: ...


class Pulse:
    """One worker's liveness as this proxy's connections to it show it, while it holds requests."""

    __slots__ = ("worker", "exchanges", "last_byte", "gap", "streams", "timer", "loop", "timeouts", "on_stall",
                 "clock")

    def __init__(self, worker: Worker, loop: asyncio.AbstractEventLoop, timeouts: Callable[[], Timeouts],
                 on_stall: Callable[[Pulse, str], None], clock: Callable[[], float]) -> None:
        self.worker = worker
        self.loop = loop
        self.timeouts = timeouts
        self.on_stall = on_stall
        self.clock = clock
        self.exchanges: set[Watched] = set()
        self.last_byte = loop.time()
        self.gap = 0.0            # EWMA of a stream's inter-chunk gap, seconds
        self.streams = 0          # exchanges relaying a stream (bytes are expected steadily)
        self.timer: asyncio.TimerHandle | None = None

    def threshold(self) -> float:
        timeouts = self.timeouts()
        return min(max(timeouts.stall_min_s, STALL_GAPS * self.gap), timeouts.idle_s)

    def join(self, exchange: Watched) -> None:
        if not self.exchanges:
            self.last_byte = self.loop.time()  # silence counts only while it holds requests
        self.exchanges.add(exchange)
        if self.timer is None:
            self.timer = self.loop.call_at(self.last_byte + self.threshold(), self._check)

    def leave(self, exchange: Watched) -> None:
        self.exchanges.discard(exchange)
        if not self.exchanges and self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def observe_gap(self, gap: float) -> None:
        self.gap += GAP_WEIGHT * (gap - self.gap)

    def _check(self) -> None:
        self.timer = None
        if not self.exchanges:
            return
        now = self.loop.time()
        threshold = self.threshold()
        silent = now - self.last_byte
        if threshold >= self.timeouts().idle_s:  # capped: each exchange's own idle deadline comes as soon
            self.timer = self.loop.call_at(now + threshold, self._check)
            return
        if silent >= threshold:
            verdict = self._verdict(threshold)
            if verdict is not None:
                self.on_stall(self, f"stalled: nothing for {silent:.1f}s while holding {len(self.exchanges)} "
                                    f"request(s) ({verdict})")
                return
            self.timer = self.loop.call_at(now + RECHECK_S, self._check)
            return
        self.timer = self.loop.call_at(self.last_byte + threshold, self._check)

    def _verdict(self, threshold: float) -> str | None:
        # a stream paused because its client reads slowly is silent by our doing, not the worker's
        if self.streams and any(e.streaming and not e.paused for e in self.exchanges):
            return "streams under way"
        worker = self.worker
        if worker.reports:
            last = worker.load.reading_at if worker.load.reading_at is not None else worker.registered_mono
            if self.clock() - last >= max(threshold, REPORTS_LAPSED_S):
                return "load reports stopped too"
        return None


class StallWatch:
    """Pulses of the workers that hold requests; a stalled one is marked in the registry and let go of."""

    def __init__(self, registry: Registry, timeouts: Callable[[], Timeouts]) -> None:
        self.registry = registry
        self.timeouts = timeouts
        self.pulses: dict[str, Pulse] = {}

    def pulse(self, worker: Worker) -> Pulse:
        pulse = self.pulses.get(worker.worker_id)
        if pulse is None or pulse.worker is not worker:
            if pulse is not None and not pulse.exchanges:
                del self.pulses[worker.worker_id]
            pulse = Pulse(worker, asyncio.get_running_loop(), self.timeouts, self._stalled, self.registry.clock)
            self.pulses[worker.worker_id] = pulse
        return pulse

    def forget_idle(self, pulse: Pulse) -> None:
        if not pulse.exchanges and self.pulses.get(pulse.worker.worker_id) is pulse:
            del self.pulses[pulse.worker.worker_id]

    def _stalled(self, pulse: Pulse, detail: str) -> None:
        worker = pulse.worker
        log.warning("worker %s %s; moving its requests", worker.worker_id, detail)
        self.registry.mark_stalled(worker, detail)
        for exchange in list(pulse.exchanges):
            exchange.worker_stalled(detail)  # closes the upstream connection: the worker sees the cancel
        pulse.exchanges.clear()
        self.forget_idle(pulse)
