"""The prefix-hit ceiling of a trace window (bench/trace_hit_bound.py) on hand-made traces whose answer is known."""

from __future__ import annotations

from bench.placement_rules import leaving_above, rules, table
from bench.trace_hit_bound import balanced, bounds, replay, replay_hit, sticky
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
    followed = replay_hit(trace, 2, 8, sticky)
    by_load = replay_hit(trace, 2, 8, balanced)
    assert followed == (3 * BLOCK_TOKENS + 4 * BLOCK_TOKENS) / (13 * BLOCK_TOKENS)
    assert by_load < followed
    figures = bounds(trace, 2, 8 * BLOCK_TOKENS)
    assert figures["unbounded"] == figures["pooled"] == figures["sticky"] == followed
    assert figures["balanced"] == by_load


def test_a_request_sent_away_from_the_worker_holding_most_of_it_is_counted_and_prefills_it_again():
    trace = [_req(0, 1, 2, 3), _req(1, 1, 2, 3, 4)]
    assert replay(trace, 2, 8, sticky) == (3 * BLOCK_TOKENS / (7 * BLOCK_TOKENS), 0)
    assert replay(trace, 2, 8, balanced) == (0.0, 1)  # the idle worker: the holder is left, nothing is found


def test_a_holder_is_left_only_while_it_prefilled_more_than_the_margin_in_the_recent_window():
    trace = [_req(0, 1, 2, 3), _req(1, 1, 2, 3, 4)]  # the first puts 3 blocks of prefill on its worker at t=0
    assert replay(trace, 2, 8, leaving_above(3 * BLOCK_TOKENS - 1))[1] == 1
    assert replay(trace, 2, 8, leaving_above(3 * BLOCK_TOKENS))[1] == 0
    # out of the window by t=1: the holder is not busier, and it keeps the request
    assert replay(trace, 2, 8, leaving_above(0), recent_s=0.5) == (3 * BLOCK_TOKENS / (7 * BLOCK_TOKENS), 0)


def test_the_placement_table_has_a_row_per_rule_and_random_shows_its_spread():
    trace = [_req(t, 1, 2, 3 + t) for t in range(6)]
    rows = table("trace_x", trace, 2, 8 * BLOCK_TOKENS, 10.0)
    assert len(rows) == len(rules())
    assert all(row.startswith("| trace_x | ") for row in rows)
    assert "-" in next(row for row in rows if "random" in row).split("|")[3]  # (min-max) over its seeds
