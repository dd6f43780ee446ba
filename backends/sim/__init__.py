"""The `sim` engine: a simulated vLLM worker (paged KV, prefix cache, continuous batching, roofline step time).

Entry point: backends.sim.process.main (via `kvroute worker --engine sim`); nothing runs at import.
"""
