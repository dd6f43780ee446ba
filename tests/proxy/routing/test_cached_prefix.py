"""What the cache-aware policies see of each worker's cache (proxy/routing/cached_prefix.py).

For a worker whose engine publishes KV events, and a request whose token ids the proxy knows: the engine's own
blocks, matched on vLLM's block hashes; for everyone else the approximate index. So a policy stops sending a
prompt to a worker whose engine evicted it, which the approximate index cannot know.
"""

from __future__ import annotations

import random
from array import array

import orjson

from proxy.kvevents import KvEventBatch, pack_hashes
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.request import CHAT, parse_request
from proxy.routing.base import PolicyDeps, make_policy
from proxy.routing.block_hash import HashScheme, block_hashes
from proxy.routing.prefix_index import PrefixIndex
from proxy.tokens.prompt import CountedPrompt, PromptTokens
from proxy.workers.loadview import EngineReading
from proxy.workers.registry import Registry

NOW = 500.0
SCHEME = HashScheme(16)
SYSTEM = " ".join(f"rule{i} says something long" for i in range(120))


def fleet(*worker_ids: str) -> tuple[Registry, PolicyDeps]:
    registry = Registry(clock=lambda: NOW)
    deps = PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(3))
    registry.add_listener(deps.engine_blocks.on_registry_event)
    for wid in worker_ids:
        registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}:1", models=["m"],
                                             kv_capacity_tokens=100_000, boot_id="b"))
        registry.get(wid).load.record_reading(EngineReading(0.2, 0, 0, 100_000), NOW, "report")
    return registry, deps


def engine_holds(registry: Registry, wid: str, hashes: list[int]) -> None:
    """`wid`'s worker reports that its engine's cache is exactly `hashes` (a snapshot)."""
    batch = KvEventBatch(seq=1, snapshot=True, stored=pack_hashes(hashes), block_size=SCHEME.block_size,
                         hash_algo=SCHEME.algo, hash_seed=SCHEME.seed)
    assert registry.record_report(wid, LoadReport(
        worker_id=wid, url=f"http://{wid}:1", models=["m"], kv_cache_usage=0.2, kv_capacity_tokens=100_000,
        num_running=0, num_waiting=0, seq=1, boot_id="b", kv_events=batch))


def chat(question: str, token_ids: list[int] | None):
    body = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": question}], "max_tokens": 16})
    request = parse_request(body, CHAT)
    if token_ids is not None:  # as proxy/tokens' counter gives them: the engine's own ids, counted
        request.tokens = PromptTokens(lambda: None)
        request.tokens.set(CountedPrompt([array("q", token_ids)], len(token_ids)))
        request.prompt_tokens = len(token_ids)
    return request


TOKENS = list(range(1000, 1000 + 1600))  # 100 blocks of 16


def test_an_event_publishing_worker_is_matched_on_its_engines_blocks_the_others_on_the_index():
    registry, deps = fleet("exact", "guessed")
    hashes = block_hashes(SCHEME, TOKENS)
    engine_holds(registry, "exact", hashes[:40])
    request = chat("q", TOKENS)
    deps.prefix_index.insert(request.prefix_hashes, "guessed", NOW, request.prefix_tokens)
    cached = deps.cached_prefix.match(request, None, NOW)
    assert cached["exact"] == 40 * 16
    assert cached["guessed"] == request.prefix_tokens[-1]
    assert deps.cached_prefix.match(request, {"guessed"}, NOW) == {"guessed": request.prefix_tokens[-1]}


def test_a_request_without_token_ids_falls_back_to_the_index_for_everyone():
    registry, deps = fleet("exact")
    engine_holds(registry, "exact", block_hashes(SCHEME, TOKENS))
    assert deps.cached_prefix.match(chat("q", None), None, NOW) == {}


def test_a_prompt_just_sent_counts_as_cached_until_the_engines_events_can_say_so():
    registry, deps = fleet("exact")
    engine_holds(registry, "exact", [])
    request = chat("q", TOKENS)
    deps.cached_prefix.insert(request, "exact", NOW)
    assert deps.cached_prefix.match(request, None, NOW)["exact"] == request.prefix_tokens[-1]
    later = NOW + deps.cached_prefix.recent.ttl_s + 1
    assert deps.cached_prefix.match(request, None, later) == {}  # the engine never stored it


def test_a_prompts_last_block_is_never_counted_as_a_hit():
    registry, deps = fleet("exact")
    hashes = block_hashes(SCHEME, TOKENS)
    engine_holds(registry, "exact", hashes)
    # 1600 tokens: vLLM computes at least the last one, so at most 99 blocks of the prompt are ever hits
    assert deps.cached_prefix.match(chat("q", TOKENS), None, NOW)["exact"] == 99 * 16


def test_kv_aware_follows_the_engine_that_holds_the_prompt_not_the_one_it_was_sent_to():
    registry, deps = fleet("a", "b")
    policy = make_policy("kv_aware", deps)
    request = chat("q", TOKENS)
    # the prompt went to a once (the index remembers), but a's engine evicted it since and b's holds it
    deps.prefix_index.insert(request.prefix_hashes, "a", NOW, request.prefix_tokens)
    engine_holds(registry, "a", [])
    engine_holds(registry, "b", block_hashes(SCHEME, TOKENS))
    workers = [registry.get("a"), registry.get("b")]
    assert {policy.select(workers, request, NOW).worker.worker_id for _ in range(20)} == {"b"}


def test_kv_cost_prices_the_prefill_the_engine_really_has_to_do():
    registry, deps = fleet("a", "b")
    policy = make_policy("kv_cost", deps)
    request = chat("q", TOKENS)
    deps.prefix_index.insert(request.prefix_hashes, "a", NOW, request.prefix_tokens)
    engine_holds(registry, "a", [])
    engine_holds(registry, "b", block_hashes(SCHEME, TOKENS))
    decision = policy.select([registry.get("a"), registry.get("b")], request, NOW)
    assert decision.worker.worker_id == "b"
    assert decision.prefill_tokens == request.prompt_tokens - 99 * 16
