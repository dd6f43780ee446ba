"""The continuous-batching scheduler, driven step by step without HTTP or clocks.

Property-style: random workloads (seeded) must never over-allocate blocks, must finish every
admitted request with exactly its tokens, and must preempt only when blocks ran out.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from backends.sim.kvcache import KVCache
from backends.sim.scheduler import RequestStatus, Scheduler, SimRequest
from backends.sim.tokens import Prompt


def _random_requests(rng: random.Random, count: int, max_len: int) -> list[SimRequest]:
    # like the engine, which refuses prompt + max_tokens over max_model_len (<= the cache size)
    shared_prefixes = [[rng.randrange(1000) for _ in range(rng.randint(8, 64))] for _ in range(3)]
    requests = []
    for i in range(count):
        prefix = rng.choice(shared_prefixes) if rng.random() < 0.5 else []
        prompt = (prefix + [rng.randrange(1000) for _ in range(rng.randint(1, max_len // 2))])[:max_len - 1]
        max_tokens = rng.randint(1, max(1, max_len - len(prompt)))
        requests.append(SimRequest(f"r{i}", Prompt(prompt), max_tokens, seed=i))
    return requests


def _run(scheduler: Scheduler, requests: list[SimRequest], rng: random.Random, max_steps: int = 100_000):
    """Add requests at random steps; check the invariants after every step."""
    pending = list(requests)
    outputs: Counter[str] = Counter()
    kv = scheduler.kv
    for step_no in range(max_steps):
        while pending and rng.random() < 0.3:
            scheduler.add(pending.pop(0))
        if not pending and not scheduler.has_work():
            return outputs, step_no
        step = scheduler.schedule()
        assert kv.num_used_blocks <= kv.num_blocks
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert sum(n for _, n in step.scheduled) <= scheduler.max_num_batched_tokens
        for request, _ in step.scheduled:  # everything scheduled has room for its new tokens
            assert len(kv.blocks_of(request.request_id)) * kv.block_size >= request.num_computed_tokens
        kv.check_invariants()
        for event in scheduler.update(step, now=float(step_no)):
            outputs[event.request.request_id] += 1
        kv.check_invariants()
    raise AssertionError("workload did not finish")


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_never_exceed_capacity_and_all_finish(seed):
    rng = random.Random(seed)
    kv = KVCache(num_blocks=rng.randint(8, 24), block_size=rng.choice([4, 8, 16]))
    max_len = kv.num_blocks * kv.block_size
    scheduler = Scheduler(kv, max_num_seqs=rng.randint(1, 12), max_num_batched_tokens=rng.choice([16, 64, 256]))
    requests = _random_requests(rng, 40, max_len)

    outputs, _ = _run(scheduler, requests, rng)

    for request in requests:
        assert request.status == RequestStatus.FINISHED
        assert outputs[request.request_id] == request.max_tokens == request.num_output_tokens
    assert kv.usage == 0.0
    # preemption happened only when the blocks asked for were more than the blocks free
    assert len(scheduler.preemption_log) == scheduler.num_preemptions
    for record in scheduler.preemption_log:
        assert record.blocks_needed > record.blocks_free


def test_no_preemption_when_the_cache_holds_everything():
    rng = random.Random(42)
    requests = _random_requests(rng, 30, 128)
    need = sum(-(-(r.num_prompt_tokens + r.max_tokens) // 8) for r in requests)
    scheduler = Scheduler(KVCache(num_blocks=need, block_size=8), max_num_seqs=64, max_num_batched_tokens=512)
    _run(scheduler, requests, rng)
    assert scheduler.num_preemptions == 0


def test_tight_cache_preempts_by_recompute_and_still_finishes():
    kv = KVCache(num_blocks=8, block_size=16)  # 128 tokens
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
    requests = [SimRequest(f"r{i}", Prompt([i] * 16), 100) for i in range(4)]
    for r in requests:
        scheduler.add(r)
    outputs, _ = _run(scheduler, [], random.Random(0))
    assert scheduler.num_preemptions > 0
    assert all(r.status == RequestStatus.FINISHED and r.num_output_tokens == 100 for r in requests)
    assert any(r.num_preemptions > 0 for r in requests)


def test_a_preempted_requests_readmission_is_counted_apart_from_the_prefix_cache_queries_as_vllm_does():
    # the counters behind the benches' prefix hit rate: only first admissions, as vLLM's PrefixCacheStats (a
    # re-admission may find its own blocks still cached: counted in, it would lift the preempting route's hit rate)
    kv = KVCache(num_blocks=8, block_size=16)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
    requests = [SimRequest(f"r{i}", Prompt([i] * 16), 100) for i in range(4)]
    for r in requests:
        scheduler.add(r)
    _run(scheduler, [], random.Random(0))
    assert scheduler.num_preemptions > 0
    assert scheduler.prefix_queries_tokens == 4 * 16  # each prompt once, however often it was preempted
    assert scheduler.prefix_hit_tokens == 0  # four distinct prompts: nothing to hit at first admission
    assert scheduler.preempted_queries_tokens > 4 * 16  # re-admissions query their prompt and output so far


def test_running_requests_decode_before_waiting_ones_prefill_and_long_prompts_are_chunked():
    kv = KVCache(num_blocks=64, block_size=16)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    first = SimRequest("first", Prompt(list(range(10))), 50)
    scheduler.add(first)
    scheduler.update(scheduler.schedule())
    assert first.num_output_tokens == 1
    long = SimRequest("long", Prompt(list(range(500, 700))), 5)  # 200 tokens, budget 64
    scheduler.add(long)
    step = scheduler.schedule()
    assert step.scheduled[0] == (first, 1)  # decode first
    assert step.scheduled[1] == (long, 63)  # the rest of the budget: a prefill chunk
    assert step.work.decode_seqs == 1 and step.work.prefill_tokens == 63
    scheduler.update(step)
    assert long.num_output_tokens == 0  # no token until the whole prompt is computed


def test_a_repeated_prompt_is_admitted_with_prefix_hits():
    kv = KVCache(num_blocks=64, block_size=16)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1024)
    prompt = Prompt(list(range(300)))
    first = SimRequest("a", prompt, 2)
    scheduler.add(first)
    while scheduler.has_work():
        scheduler.update(scheduler.schedule())
    second = SimRequest("b", prompt, 2)
    scheduler.add(second)
    step = scheduler.schedule()
    assert second.num_cached_tokens == 288  # 18 full blocks; the 19th holds the last token
    assert step.scheduled == [(second, 12)]
    assert scheduler.prefix_hit_tokens == 288 and scheduler.prefix_queries_tokens == 600


def test_requests_sharing_a_new_prefix_in_one_step_compute_it_once_as_vllm_v1_does():
    # vLLM v1 caches the blocks a step will compute when it schedules them: the second request of the step
    # reuses the first's, and so does one admitted while the first's later chunks are still being computed
    kv = KVCache(num_blocks=64, block_size=16)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1024)
    system = list(range(300))
    first = SimRequest("a", Prompt(system + [900, 901]), 2)
    second = SimRequest("b", Prompt(system + [902, 903]), 2)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.schedule()
    assert step.scheduled == [(first, 302), (second, 302 - 288)]
    assert step.work.prefill_tokens == 302 + 14 and second.num_cached_tokens == 288
    assert scheduler.prefix_hit_tokens == 288
    chunked = Scheduler(KVCache(num_blocks=64, block_size=16), max_num_seqs=4, max_num_batched_tokens=160)
    third, fourth = SimRequest("c", Prompt(system + [904]), 2), SimRequest("d", Prompt(system + [905]), 2)
    chunked.add(third)
    chunked.update(chunked.schedule())  # its first chunk: 160 tokens
    chunked.add(fourth)
    # the running one's last chunk first, then the newcomer: it hits the blocks that chunk is computing
    assert chunked.schedule().scheduled == [(third, 141), (fourth, 301 - 288)]
    assert fourth.num_cached_tokens == 288


def test_abort_frees_blocks_at_once():
    kv = KVCache(num_blocks=16, block_size=16)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1024)
    running = SimRequest("run", Prompt(list(range(100))), 50)
    scheduler.add(running)
    scheduler.update(scheduler.schedule())
    waiting = SimRequest("wait", Prompt(list(range(10))), 5)
    scheduler.add(waiting)
    scheduler.abort(running)
    scheduler.abort(waiting)
    assert kv.usage == 0.0 and not scheduler.has_work()
    assert running.status == waiting.status == RequestStatus.ABORTED
