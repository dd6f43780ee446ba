"""The proxy process's cyclic garbage collector while it serves: what it scans, and how often.

Owns two settings, applied once the app is built and before the first request (proxy/app.py's serve):
- gc.freeze(): every object alive then (modules, classes, config, the app: most of the heap) moves to a
  permanent generation that collections no longer walk. A full collection otherwise walks it all, tens of
  ms each on this proxy, a few times a minute under load.
- a first-generation threshold of GEN0_THRESHOLD allocations instead of CPython's 700: a request's objects
  (coroutines, futures, parsed bodies, timer handles) mostly die with it, so collecting that often finds
  little but costs a traversal each time, and each collection of the young moves survivors towards the
  older generations, whose collections cost more.
Measured with gc.callbacks on the overhead bench's stress workload (one run each,
bench/results/2026-12-02-proxy-gc-share.md): time in the collector 11.9% of the proxy's CPU with CPython's
settings, 11.0% with the freeze alone, 5.7% with both. Same-run A/B, 3 repeats, median (min..max)
(bench/results/2026-12-02-overhead-gc-ab.md; `kv_aware@gc_freeze=False+gc_gen0=700+gc_gen1=10+gc_gen2=10`
runs CPython's settings): CPU per request streamed 590 (545..595) -> 560 (535..565) us, stress 357 (352..362)
-> 330 (323..338), non-streamed 360 (350..375) -> 345 (335..360).
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
