"""How far a worker's own account of its load is believed: each reading against what the proxy measured.

Owns the checks, the trust factor and the reading routing then sees; no I/O, no policy. The registry
passes every reading (report or /metrics scrape) through `ReportTrust.weigh`.

A worker's numbers are its own word. The proxy knows some things for certain: the requests it sent
there that are still in flight, and which of them have produced output. A reading disagrees when
  - it counts fewer running + waiting requests than this proxy alone holds there (sent at least
    its admission rules' dispatch_visible_after_s before), beyond a slack for answers still on the wire;
  - it shows (almost) no KV in use while this proxy's requests are producing output there; or
  - its KV usage has not moved across FROZEN_READINGS readings while requests came and went there.
From the second disagreeing reading in a row each one quarters the trust factor t; each agreeing
reading taken while a lie would have shown (enough requests held there) gives back RECOVER. Readings
while it holds (almost) nothing tell nothing.

While t < 1 routing sees the reading blended with the proxy's own view, weighted by t:
    capacity = min(reported, peers' capacity)
    usage    = t x reported used / capacity + (1 - t) x max(reported used, KV tokens held) / capacity
    waiting  = t x reported + (1 - t) x max(reported, held - reported running)
where peers' capacity is the largest any trusted worker serving the same models reports (the capacity
assumed for a worker that never said, without one): a capacity claim can be off by any factor, so it
is capped rather than weighted. At t = 0 a worker is routed on the proxy's own in-flight counts, sized
like its honest peers; an honest worker's blend barely differs from its report. What a lying worker
can still do: docs/security.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from proxy.workers.loadview import EngineReading, WorkerLoad

STRIKES = 2              # consecutive disagreeing readings before trust falls (one may lag a burst)
DISTRUST = 0.25          # trust is multiplied by this per disagreeing reading from the STRIKES-th on
RECOVER = 0.05           # and grows by this per agreeing reading taken while requests were held there
TRUST_FLOOR = 0.01       # below it, none: the worker is routed on the proxy's own counts alone
COUNT_SLACK = 2          # requests whose end may still be on the wire when a reading is taken...
COUNT_SLACK_SHARE = 0.25  # ...plus this share of those held
FROZEN_READINGS = 8      # readings with the very same KV usage while requests finished there


class ReportTrust:
    """One worker's trust factor and the state its checks need."""

    __slots__ = ("factor", "strikes", "disagreements", "_last_usage", "_frozen")

    def __init__(self) -> None:
        self.factor = 1.0
        self.strikes = 0          # consecutive disagreeing readings
        self.disagreements = 0    # all of them, for /workers
        self._last_usage: float | None = None
        self._frozen = 0

    def weigh(self, reading: EngineReading, load: WorkerLoad, now: float,
              peer_capacity: Callable[[], int]) -> EngineReading:
        """Check `reading` against what `load` holds, update the factor, and return what routing should see
        (`peer_capacity` is asked only then: its trusted peers' capacity, see the module docstring)."""
        held, held_tokens = load.held_before(now - load.rules.dispatch_visible_after_s)
        outputting = min(load.outputting, held)
        disagrees = self.disagrees(reading, load, held, outputting)
        # a reading tells something only when a lie would have shown: enough held to pass the slack
        if disagrees or held * (1 - COUNT_SLACK_SHARE) > COUNT_SLACK or outputting >= 2:
            if disagrees:
                self.strikes += 1
                self.disagreements += 1
                if self.strikes >= STRIKES:
                    self.factor = 0.0 if self.factor * DISTRUST < TRUST_FLOOR else self.factor * DISTRUST
            else:
                self.strikes = 0
                self.factor = min(1.0, self.factor + RECOVER)
        if self.factor >= 1.0:
            return reading
        return _blend(reading, load.capacity_tokens, peer_capacity(), self.factor, held, held_tokens)

    def disagrees(self, reading: EngineReading, load: WorkerLoad, held: int, outputting: int) -> bool:
        churned = outputting > 0 and load.finished_since_reading > 0  # KV was freed and taken since the last one
        if reading.kv_usage != self._last_usage:
            self._frozen = 0
        elif churned:
            self._frozen += 1
        self._last_usage = reading.kv_usage
        if self._frozen >= FROZEN_READINGS:
            return True
        if held > reading.num_running + reading.num_waiting + COUNT_SLACK + COUNT_SLACK_SHARE * held:
            return True
        capacity = reading.capacity_tokens or load.capacity_tokens
        return outputting >= 2 and reading.kv_usage * capacity < 1.0  # a request producing output holds KV


def _blend(reading: EngineReading, known_capacity: int, peer_capacity: int, t: float, held: int,
           held_tokens: int) -> EngineReading:
    reported_capacity = reading.capacity_tokens or known_capacity
    capacity = max(1, min(reported_capacity, peer_capacity))
    used = reading.kv_usage * reported_capacity
    usage = (t * min(used, capacity) + (1 - t) * min(max(used, held_tokens), capacity)) / capacity
    waiting = t * reading.num_waiting + (1 - t) * max(reading.num_waiting, held - reading.num_running)
    return replace(reading, kv_usage=usage, num_waiting=round(waiting), capacity_tokens=capacity)
