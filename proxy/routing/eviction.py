"""How much of an engine's hot prefix cache a request's new KV pushes out: the arithmetic kv_aware's eviction term
and kv_cost's evict(w) share.

vLLM and TurboMind keep a finished request's blocks among the free ones and reuse the least recently used first:
what a request needs beyond the free blocks that hold no hot prefix comes out of the hot ones, which a later
request then prefills again.
"""

from __future__ import annotations


def evicted_tokens(free: float, hot: float, new: float) -> float:
    """Hot prefix tokens pushed out of `free` tokens of free KV (of which the hot ones sit in up to all) by `new`
    tokens of KV; 0 when nothing is hot or nothing is free (a request then waits for room rather than evicting)."""
    if hot <= 0 or not free > 0.0:
        return 0.0
    held = hot if hot < free else free
    spill = held + new - free
    if not spill > 0.0:
        return 0.0
    return spill if spill < held else held
