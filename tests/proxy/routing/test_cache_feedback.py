"""Each answer's cached tokens against what routing believed (proxy/routing/cache_feedback.py, proxy/dataplane/
usage.py): the usage read from the answer's tail, the per-worker accuracy, the approximate index corrected where
engines publish no KV events, and a tokenizer the engines' answers contradict set aside for its model.

The processes end to end: tests/e2e/test_cache_feedback_sims.py (sims), tests/e2e/vllm/test_vllm_fleet.py (vLLM).
"""

from __future__ import annotations

import orjson
import pytest

from proxy.dataplane.outcome import Relayed
from proxy.dataplane.relay import Relay
from proxy.dataplane.usage import TAIL_BYTES, answered_usage, usage_in
from proxy.request import CHAT, parse_request
from proxy.routing.base import Decision
from proxy.routing.block_hash import block_hashes
from proxy.routing.cache_feedback import MIN_ANSWERS, AnswerUsage, CacheFeedback
from proxy.routing.tokenizer_store import TokenizerStore
from proxy.tokens.bundle import read_model_dir
from tests.e2e.test_tokenizer_handover import TINY
from tests.proxy.routing.test_cached_prefix import NOW, SCHEME, chat, engine_holds, fleet

# --- reading the answer ------------------------------------------------------------------------------------

VLLM_BODY = (b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
             b'"message":{"role":"assistant","content":"a \\"usage\\": {\\"cached_tokens\\": 999}"},"finish_reason":'
             b'"length"}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":300,"total_tokens":'
             b'302,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":256,"multimodal_tokens":{"image":'
             b'64}}},"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":null}')


def test_the_usage_is_read_from_an_answers_end_as_vllm_and_lmdeploy_write_it():
    assert usage_in(VLLM_BODY) == AnswerUsage(300, 256)
    lmdeploy = (b'{"id": "1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}], '
                b'"usage": {"prompt_tokens": 40, "total_tokens": 41, "completion_tokens": 1, '
                b'"prompt_tokens_details": {"cached_tokens": 32}}}')
    assert usage_in(lmdeploy) == AnswerUsage(40, 32)
    # vLLM without --enable-prompt-tokens-details: the prompt is counted, the cache not
    assert usage_in(b'{"usage":{"prompt_tokens":7,"completion_tokens":1,"prompt_tokens_details":null}}') == \
        AnswerUsage(7, None)
    assert usage_in(b'{"choices":[],"usage":null}') is None
    assert usage_in(b'{"content":"the word \\"usage\\" alone"}') is None  # inside a string: escaped
    assert usage_in(VLLM_BODY[:-120]) is None  # cut inside the usage object


def relay_of(*pieces: bytes, whole: bytes | None = None) -> Relay:
    class Closed:  # a client that left: the relay writes nothing, as it does then
        closed = True

    relay = Relay(Closed(), 0, b"", False, None, False)  # type: ignore[arg-type]
    if whole is not None:
        relay.whole(200, [], {}, whole)
    for piece in pieces:
        relay.flush([piece])
    return relay


def request(stream: bool = False, include_usage: bool = False):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return parse_request(orjson.dumps(body), CHAT)


def test_a_stream_gives_its_usage_only_when_the_client_asked_for_it_even_after_a_separate_done():
    chunks = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' * 200,
              b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,'
              b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n', b"data: [DONE]\n\n"]
    ok = Relayed(200, 1.0)
    assert answered_usage(request(True, True), relay_of(*chunks), ok) == AnswerUsage(12, 0)
    assert answered_usage(request(True, False), relay_of(*chunks), ok) is None
    assert answered_usage(request(), relay_of(whole=VLLM_BODY), ok) == AnswerUsage(300, 256)
    for failed in (Relayed(500, 1.0), Relayed(200, 1.0, worker_failed=True), Relayed(200, 1.0, client_gone=True)):
        assert answered_usage(request(), relay_of(whole=VLLM_BODY), failed) is None
    # a large answer is read from its last bytes only
    huge = b'{"choices":[{"message":{"content":"' + b"y" * 4 * TAIL_BYTES + b'"}}],' + VLLM_BODY[VLLM_BODY.index(
        b'"usage"'):]
    assert answered_usage(request(), relay_of(whole=huge), ok) == AnswerUsage(300, 256)


# --- accuracy and the approximate index ------------------------------------------------------------------


def setup(*workers: str):
    registry, deps = fleet(*workers)
    feedback = CacheFeedback(registry, lambda: deps.cached_prefix, TokenizerStore(registry), lambda name: name)
    return registry, deps, feedback


def sent(deps, feedback, registry, routed, wid: str, at: float, usage) -> Decision:
    """`routed` goes to `wid` as a cache-aware policy sends it; the engine answers `usage` (or usage(prediction))."""
    cached = deps.cached_prefix.match(routed, None, at).get(wid, 0)
    decision = Decision(registry.get(wid), "test", 0, cached_tokens=cached)
    expected = feedback.expect(decision, routed, at)
    deps.cached_prefix.insert(routed, wid, at)
    feedback.observe(expected, routed, usage(cached) if callable(usage) else usage, at + 1)
    return decision


def long_chat(tag: str):
    """A prompt long enough to be counted before routing (an estimate of 1024 tokens or more)."""
    return chat(" ".join(f"{tag}{j}" for j in range(400)), None)


def test_each_answer_is_compared_with_the_prediction_in_the_engines_tokens():
    registry, deps, feedback = setup("w1", "w2")
    first = chat("first question", None)
    sent(deps, feedback, registry, first, "w1", NOW, AnswerUsage(first.prompt_tokens, 0))
    again = chat("second question", None)
    # the engine counts the prompt twice as long as the estimate, and reused a little less than predicted
    decision = sent(deps, feedback, registry, again, "w1", NOW + 5,
                    lambda cached: AnswerUsage(2 * again.prompt_tokens, 2 * cached - 48))
    assert decision.cached_tokens > 700  # the shared system prompt, in estimated tokens
    stats = registry.get("w1").cache_prediction.to_json()
    predicted = 2 * decision.cached_tokens  # the estimate, scaled by the engine's count of the whole prompt
    assert stats["answers"] == 2 and stats["exact_answers"] == 0
    assert stats["predicted_tokens"] == predicted and stats["actual_tokens"] == predicted - 48
    assert stats["mean_abs_error_tokens"] == 48 / 2
    assert stats["last"] == {"predicted": predicted, "actual": predicted - 48, "source": "approximate"}
    assert stats["index_corrections"] == {"evicted": 0, "reused": 0}  # within rounding to the engine's blocks
    assert registry.get("w2").cache_prediction is None  # never answered


def test_an_engine_that_evicted_what_the_index_believed_makes_that_workers_older_prompts_stop_counting():
    registry, deps, feedback = setup("w1", "w2")
    old = chat("an older conversation", None)
    old.prefix_hashes, old.prefix_tokens = [h ^ 0x5A5A for h in old.prefix_hashes], list(old.prefix_tokens)
    sent(deps, feedback, registry, old, "w1", NOW, AnswerUsage(old.prompt_tokens, 0))
    sent(deps, feedback, registry, old, "w2", NOW, AnswerUsage(old.prompt_tokens, 0))
    hot = chat("q1", None)
    sent(deps, feedback, registry, hot, "w1", NOW + 10, AnswerUsage(hot.prompt_tokens, 0))
    hit = sent(deps, feedback, registry, chat("q2", None), "w1", NOW + 20,
               lambda cached: AnswerUsage(hot.prompt_tokens, cached))  # the system prompt was there
    assert hit.cached_tokens > 700
    assert deps.cached_prefix.match(old, None, NOW + 30) == {"w1": old.prefix_tokens[-1], "w2": old.prefix_tokens[-1]}
    # the engine had evicted the system prompt it was last sent at NOW + 20 ...
    sent(deps, feedback, registry, chat("q3", None), "w1", NOW + 30, AnswerUsage(hot.prompt_tokens, 0))
    assert registry.get("w1").cache_prediction.evicted == 1
    # ... so, least recently used first, it holds nothing sent to it before then: only w2 still has `old`
    assert deps.cached_prefix.match(old, None, NOW + 31) == {"w2": old.prefix_tokens[-1]}
    # while the prompt it just served again is held again
    assert deps.cached_prefix.match(chat("q4", None), None, NOW + 31)["w1"] == hit.cached_tokens


def test_an_engine_that_never_reports_a_hit_corrects_nothing():
    # (LMDeploy's TurboMind reports 0 when its metrics are off: 0 then means "not counted", not "evicted")
    registry, deps, feedback = setup("w1", "w2")
    for i in range(3):
        sent(deps, feedback, registry, chat(f"q{i}", None), "w1", NOW + i, AnswerUsage(500, 0))
    stats = registry.get("w1").cache_prediction
    assert stats.answers == 3 and stats.evicted == 0
    assert deps.cached_prefix.match(chat("q9", None), None, NOW + 5)["w1"] > 700


def test_an_engine_that_reused_more_than_believed_has_those_blocks_recorded_as_reused():
    registry, deps, feedback = setup("w1", "w2")
    routed = chat("first", None)
    sent(deps, feedback, registry, routed, "w1", NOW, AnswerUsage(routed.prompt_tokens, routed.prompt_tokens - 20))
    assert registry.get("w1").cache_prediction.reused == 1
    assert deps.prefix_index.hot_tokens("w1") > 700  # the blocks the engine had: reused there


# --- the tokenizer check -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle():
    found = read_model_dir(TINY)
    assert found is not None, "build the tiny model first: kvroute make-tiny-model models/tiny-qwen3-vl"
    return found


async def counted_setup(bundle):
    registry, deps = fleet("w1", "w2")
    store = TokenizerStore(registry)
    assert await store.adopt(bundle.sha256, ["m"], bundle.to_wire())
    feedback = CacheFeedback(registry, lambda: deps.cached_prefix, store, lambda name: name)
    return registry, deps, store, feedback


async def test_answers_that_count_the_prompt_otherwise_set_the_models_tokenizer_aside(bundle):
    registry, deps, store, feedback = await counted_setup(bundle)
    for i in range(MIN_ANSWERS):
        routed = long_chat(f"question{i}x")
        await store.count(routed, "m")
        assert routed.exact_tokens
        counted = routed.tokens.counted.num_tokens
        assert store.counter("m") is not None
        sent(deps, feedback, registry, routed, "w1", NOW + i, AnswerUsage(counted + 9, 0))  # a default system line
    assert store.counter("m") is None and store.distrusted() == {"m": bundle.sha256}
    assert feedback.mismatches == {"m": 1}
    routed = long_chat("after")
    await store.count(routed, "m")
    assert routed.tokens is None and not routed.exact_tokens  # estimated: never refused on the wrong count
    # the same tokenizer handed over again stays aside; a different one would count again
    assert await store.adopt(bundle.sha256, ["m"], None) and store.counter("m") is None


async def test_answers_that_agree_or_race_the_engines_events_keep_the_tokenizer(bundle):
    registry, deps, store, feedback = await counted_setup(bundle)
    routed = chat("warm", None)
    await store.count(routed, "m")
    ids = routed.tokens.counted.token_ids
    for i in range(3 * MIN_ANSWERS):
        routed = chat("warm", None)
        await store.count(routed, "m")
        if i == 0:  # w1's engine publishes its cache, empty at first: every answer races its events
            engine_holds(registry, "w1", [])
        engine_reused = (len(ids) - 1) // 16 * 16 if i else 0
        sent(deps, feedback, registry, routed, "w1", NOW + i, AnswerUsage(len(ids), engine_reused))
    assert store.counter("m") is not None and feedback.mismatches == {}
    assert registry.get("w1").cache_prediction.exact_answers == 3 * MIN_ANSWERS


async def test_ids_that_differ_at_the_same_count_are_found_by_blocks_the_engines_events_never_show(bundle):
    registry, deps, store, feedback = await counted_setup(bundle)
    routed = chat("warm", None)
    await store.count(routed, "m")
    ids = routed.tokens.counted.token_ids
    # the engine's tokenizer numbers one token otherwise: as many tokens, none of the proxy's block names
    engine_holds(registry, "w1", block_hashes(SCHEME, [ids[0] + 1, *ids[1:]]))
    for i in range(MIN_ANSWERS):
        routed = chat("warm", None)
        await store.count(routed, "m")
        # 10 s apart: no recent dispatch stands in for the engine's events
        sent(deps, feedback, registry, routed, "w1", NOW + 10 * i, AnswerUsage(len(ids), (len(ids) - 1) // 16 * 16))
        assert registry.get("w1").cache_prediction.last == (0, (len(ids) - 1) // 16 * 16, "exact")
    assert store.counter("m") is None and feedback.mismatches == {"m": 1}
