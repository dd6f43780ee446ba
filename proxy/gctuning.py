"""The proxy process's cyclic garbage collector while it serves: what it scans, and how often.

Owns two settings, applied once the app is built and before the first request (proxy/app.py's serve); it
does not touch allocation itself:
- gc.freeze(): every object alive then (modules, config, the app: most of the heap) moves to a permanent
  generation that later collections no longer walk;
- a first-generation threshold of GEN0_THRESHOLD allocations instead of CPython's 700: a request's objects
  mostly die with it, so collecting that often finds little and moves survivors towards costlier generations.
What the collector cost before and after, in the overhead bench: docs/design/data-plane.md.
"""

from __future__ import annotations

import gc

FREEZE_AT_START = True
GEN0_THRESHOLD = 10_000
GEN1_THRESHOLD = 20  # collections of the generation below between two of this one (CPython: 10)
GEN2_THRESHOLD = 20


def tune_for_serving() -> None:
    """Apply the settings above; once the app is built (what exists then is frozen)."""
    if FREEZE_AT_START:
        gc.collect()  # what is garbage already is not frozen with the rest
        gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
