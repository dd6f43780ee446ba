"""What a disaggregated model's decision hands the data plane: the workers of each stage of one request.

Owns the types only: proxy/routing/split.py fills them from disagg.py's Plan, proxy/dataplane/stages.py runs
them (encode, then prefill, then decode), and each stage's accounting begins and ends on its own worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.routing.disagg import Plan
from proxy.workers.registry import Worker

PREFILL, DECODE, ENCODE = "prefill", "decode", "encode"  # a stage Decision's reason: which leg it is


@dataclass(frozen=True, slots=True)
class Stage:
    """One leg of a split request: where it runs and what it adds to that worker's load."""

    worker: Worker
    kv_tokens: int  # KV it holds there (the prompt on a prefill worker until the decode worker pulls it)
    prefill_tokens: int  # prompt tokens it computes there
    queue_s: float = 0.0  # predicted wait there (what the stage's measured time is corrected by when learning)


@dataclass(frozen=True, slots=True)
class StagePlan:
    """The stages of one request besides the one on its Decision's worker (which decodes, or runs it whole)."""

    plan: Plan  # disagg.py's decision: the debug header and traces show it
    prefill: Stage | None  # a split: the prompt is computed here first, its KV goes to the Decision's worker
    encode: Stage | None  # images: their vision encoder output comes from here first
    media_hashes: tuple[str, ...] = ()  # the request's images (the encoder's cache keys)

    @property
    def whole(self) -> bool:
        """Nothing runs before the Decision's worker: the request goes there whole, as any other."""
        return self.prefill is None and self.encode is None
