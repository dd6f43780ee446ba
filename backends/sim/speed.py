"""The sim engine's recent speed, as a worker reports it to the proxy: prefill tokens/s and decode step time.

Owns the running fits over finished steps (simulated seconds); it does not time anything itself
(engine.py hands it each step) and knows nothing of the proxy (server.py converts to wall time).
"""

from __future__ import annotations

from backends.sim.cost import StepWork

# Weight of the past per step: about the last 200 steps count.
DECAY = 0.995


class StepSpeed:
    """Marginal prefill cost (least squares of step time on prompt tokens) and mean decode-only step time."""

    __slots__ = ("_n", "_sx", "_sy", "_sxx", "_sxy", "_decode_s")

    def __init__(self) -> None:
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._decode_s: float | None = None

    def observe(self, work: StepWork, duration_s: float) -> None:
        if work.prefill_tokens:
            x = float(work.prefill_tokens)
            self._n = self._n * DECAY + 1.0
            self._sx = self._sx * DECAY + x
            self._sy = self._sy * DECAY + duration_s
            self._sxx = self._sxx * DECAY + x * x
            self._sxy = self._sxy * DECAY + x * duration_s
        elif work.decode_seqs:
            self._decode_s = duration_s if self._decode_s is None else 0.9 * self._decode_s + 0.1 * duration_s

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens per second of extra step time (the slope, not counting a step's fixed part)."""
        spread = self._n * self._sxx - self._sx * self._sx
        if self._n < 3 or spread <= 1e-9 * self._n * self._sxx:
            return None  # all prompts the same size so far: no slope to read
        slope = (self._n * self._sxy - self._sx * self._sy) / spread
        return 1.0 / slope if slope > 0 else None

    @property
    def decode_step_s(self) -> float | None:
        return self._decode_s
