"""What kv_cost predicted for the worker it picked, carried on its Decision.

Owns the type only: kv_cost fills it and learns from it once the request is over; admission reads it to
weigh holding a request against sending it now. Policies that predict no times leave Decision.prediction None.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvCostPrediction:
    """Seconds and tokens kv_cost's model predicted on the chosen worker (docs/design/decision-model.md)."""

    queue_s: float  # waiting there before its prefill starts
    ttft_s: float  # queue_s + its prefill there (of what the worker does not cache)
    cold_prefill_s: float  # the prefill of the whole prompt there, as on a worker without its prefix
    uncached_media_tokens: int  # image/video tokens among the prompt tokens it computes
