"""The prefix-hit ceiling of a trace window (bench/trace_hit_bound.py) on hand-made traces whose answer is known."""

from __future__ import annotations

from bench.trace_hit_bound import _balanced, _sticky, bounds, replay_hit
from bench.traces import BLOCK_TOKENS, TraceRequest


def _req(t: float, *blocks: int, tokens: int | None = None) -> TraceRequest:
    return TraceRequest(t, tokens if tokens is not None else len(blocks) * BLOCK_TOKENS, 8, blocks)


def test_a_prompt_that_extends_an_earlier_one_finds_its_blocks_but_computes_its_last_token():
    trace = [_req(0, 1, 2, 3), _req(1, 1, 2, 3, 4), _req(2, 5), _req(3, 1, 2)]
    # 3 blocks of the second; all of the fourth but its last token
    assert replay_hit(trace, 1, None) == (3 * BLOCK_TOKENS + 2 * BLOCK_TOKENS - 1) / (10 * BLOCK_TOKENS)


def test_a_full_cache_evicts_a_prompts_tail_before_its_head():
    trace = [_req(0, 1, 2, 3), _req(1, 5), _req(2, 1, 2)]
    # three blocks of room: the second prompt's block pushes out block 3, not block 1
    assert replay_hit(trace, 1, 3) == (2 * BLOCK_TOKENS - 1) / (6 * BLOCK_TOKENS)


def test_placing_by_load_alone_loses_the_hits_that_following_the_prefix_keeps():
    trace = [_req(0, 1, 2, 3), _req(1, 1, 2, 3, 4), _req(2, 5), _req(3, 1, 2, 3, 4, 6)]
    sticky = replay_hit(trace, 2, 8, _sticky)
    balanced = replay_hit(trace, 2, 8, _balanced)
    assert sticky == (3 * BLOCK_TOKENS + 4 * BLOCK_TOKENS) / (13 * BLOCK_TOKENS)
    assert balanced < sticky
    figures = bounds(trace, 2, 8 * BLOCK_TOKENS)
    assert figures["unbounded"] == figures["pooled"] == figures["sticky"] == sticky
    assert figures["balanced"] == balanced
