"""The sim's KV-cache events, in vLLM's format, and the worker's subscription that forwards them to the proxy.

In process: a sim engine publishes over real ZMQ sockets (ipc://) and a worker's subscriber keeps a copy equal
to the engine's cache, under the block hashes the proxy computes from the /tokenize token ids. Across processes:
a sim worker keeps the proxy's view equal to its cache through evictions and a cache reset; a report that never
arrived makes the proxy ask for, and the worker send, everything again.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.kv_mirror import KvMirror
from backends.kv_subscriber import EventEndpoints, KvSubscriber, local_endpoints
from backends.reporter import Load, ProxyReporter
from backends.sim.engine import SimEngine
from backends.sim.kv_publisher import SimKvEvents
from backends.sim.presets import get_preset
from backends.sim.scheduler import SimRequest
from backends.sim.tokens import IMAGE_PAD, chat_prompt, public_token_ids
from proxy.protocol import WorkerRegistration
from proxy.routing.block_hash import HashScheme, block_hashes
from proxy.routing.media_ids import media_uuid
from tests.sim.conftest import png_data_url, read_state
from tests.support.fleet import Fleet
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
SCHEME = HashScheme(BLOCK)


def kv_view(proxy_url: str, worker_id: str) -> dict:
    """The proxy's view of a worker's engine cache, from its /metrics: blocks, state, resyncs."""
    view: dict = {}
    for family in text_string_to_metric_families(httpx.get(proxy_url + "/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.labels.get("worker") != worker_id:
                continue
            if sample.name == "kvroute:worker_kv_event_blocks":
                view["blocks"] = sample.value
            elif sample.name == "kvroute:worker_kv_event_view" and sample.value == 1.0:
                view["state"] = sample.labels["state"]
            elif sample.name == "kvroute:worker_kv_event_resyncs_total":
                view["resyncs"] = sample.value
    return view


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def run(engine: SimEngine, messages: list[dict], max_tokens: int = 3) -> SimRequest:
    request = SimRequest(f"r{time.monotonic_ns()}", chat_prompt(messages), max_tokens)
    queue = engine.submit(request)
    while not (await asyncio.wait_for(queue.get(), 10)).finished:
        pass
    return request


async def settled(subscriber: KvSubscriber, events: SimKvEvents) -> None:
    """Until the subscriber applied every batch the publisher sent."""
    deadline = time.monotonic() + 10
    while subscriber.received < events.publisher._seq:
        assert time.monotonic() < deadline, "the subscriber did not receive the published batches"
        await asyncio.sleep(0.01)


def expected_hashes(messages: list[dict]) -> list[int]:
    """The prompt's blocks as the proxy computes them: /tokenize's token ids, each image's uuid at its span."""
    prompt = chat_prompt(messages)
    tokens = public_token_ids(prompt.token_ids)
    media = [(name, start, length) for (start, length), name in zip(prompt.media_spans, prompt.media_ids, strict=True)]
    assert all(tokens[s] == IMAGE_PAD for _, s, _ in media)
    return block_hashes(SCHEME, tokens, media)


@pytest.fixture
async def engine_and_feed():
    preset = get_preset("cpu-tiny").with_overrides(kv_capacity_tokens=BLOCK * 96, block_size=BLOCK)
    engine = SimEngine(preset, time_scale=100.0)
    events = SimKvEvents(engine, forward=True)
    await events.start()
    engine.start()
    yield engine, events
    await engine.stop()
    await events.stop()


async def test_a_worker_copy_of_the_sims_cache_is_exact_under_the_proxys_block_hashes(engine_and_feed):
    engine, events = engine_and_feed
    subscriber, mirror = events.feed.subscriber, events.mirror
    image = png_data_url(96, 64)
    text = [{"role": "user", "content": words("alpha", 120)}]
    with_uuid = [{"role": "user", "content": [{"type": "text", "text": words("beta", 40)},
                                              {"type": "image_url", "image_url": {"url": image}, "uuid": "photo-7"},
                                              {"type": "text", "text": words("gamma", 60)}]}]
    without_uuid = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                 {"type": "text", "text": words("delta", 60)}]}]
    for messages in (text, with_uuid, without_uuid):
        await run(engine, messages)
    await settled(subscriber, events)
    held = set(mirror._copies)
    for messages in (text, with_uuid, without_uuid):
        assert set(expected_hashes(messages)) <= held
    assert chat_prompt(without_uuid).media_ids == [media_uuid(image)]  # the name the proxy gives it too
    assert len(held) == engine.kv.num_cached_blocks

    # the cache is 96 blocks: new prompts evict the old ones, and the copy loses them with the engine
    for i in range(4):
        await run(engine, [{"role": "user", "content": words(f"flood{i}", 200)}])
    await settled(subscriber, events)
    held = set(mirror._copies)
    assert not set(expected_hashes(text)) <= held and len(held) == engine.kv.num_cached_blocks

    engine.kv.reset_prefix_cache()  # nobody holds a block now: vLLM says AllBlocksCleared
    events.flush()
    await settled(subscriber, events)
    assert len(mirror) == 0 and mirror.stats["cleared"] == 1


async def test_a_skipped_batch_is_replayed_and_one_the_publisher_no_longer_has_is_lost(engine_and_feed):
    engine, events = engine_and_feed
    # a second subscriber fed by hand from the publisher's own batches, so that one can be skipped
    mirror = KvMirror(SCHEME.algo, SCHEME.seed, BLOCK)
    subscriber = KvSubscriber(events.feed.endpoints, mirror)
    for i in range(3):
        await run(engine, [{"role": "user", "content": words(f"p{i}", 80)}])
    await settled(events.feed.subscriber, events)
    batches = list(events.publisher._buffer)
    assert len(batches) >= 3
    await subscriber.receive(*batches[0])
    await subscriber.receive(*batches[2])  # batch 1 skipped: fetched from the publisher's replay socket
    for batch in batches[3:]:
        await subscriber.receive(*batch)
    assert set(mirror._copies) == set(events.mirror._copies) and mirror.complete

    await run(engine, [{"role": "user", "content": words("late", 80)}])  # batches this subscriber never gets
    await settled(events.feed.subscriber, events)
    events.publisher._buffer.clear()  # ... and the publisher's replay buffer has moved past them
    await run(engine, [{"role": "user", "content": words("later", 80)}])
    await settled(events.feed.subscriber, events)
    await subscriber.receive(*events.publisher._buffer[-1])
    assert not mirror.complete and mirror.stats["lost"] == 1
    await subscriber.stop()


async def test_a_standalone_sim_publishes_where_kv_events_config_says(sim):
    endpoints = local_endpoints()
    config = endpoints.vllm_config()
    try:
        _, url = sim("--served-model-name", "m1", "--block-size", str(BLOCK), "--kv-events-config", json.dumps(
            {"endpoint": config["endpoint"], "replay_endpoint": config["replay_endpoint"], "topic": "kv-events"}))
        mirror = KvMirror(SCHEME.algo, SCHEME.seed)
        subscriber = KvSubscriber(EventEndpoints(config["endpoint"], config["replay_endpoint"]), mirror)
        await subscriber.start()
        try:
            messages = [{"role": "user", "content": words("epsilon", 100)}]
            async with httpx.AsyncClient(timeout=30) as client:
                sources = (await client.get(url + "/kv_event_sources")).json()
                assert sources["0"]["endpoint"] == config["endpoint"]
                tokens = (await client.post(url + "/tokenize", json={"messages": messages})).json()["tokens"]
                resp = await client.post(url + "/v1/chat/completions",
                                         json={"model": "m1", "messages": messages, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
            want = block_hashes(SCHEME, tokens)
            await asyncio.to_thread(wait_until, lambda: set(want) <= set(mirror._copies), 10, 0.05,
                                    "the sim's BlockStored events")
        finally:
            await subscriber.stop()
    finally:
        endpoints.close()


def test_a_sim_worker_keeps_the_proxys_view_equal_to_its_cache(procs, tmp_path):
    fleet = Fleet(procs, tmp_path)
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1, kv_capacity_tokens=BLOCK * 128, extra=("--block-size", str(BLOCK)))

    def equal_to_the_engine() -> bool:
        view = kv_view(fleet.url, "sim-0")
        return view["state"] == "exact" and view["blocks"] == read_state(sim.url)["cached_blocks"]

    for i in range(6):  # 6 x ~270 tokens through a 128-block cache: the first prompts are evicted
        assert fleet.chat(words(f"zeta{i}", 200), max_tokens=2).status_code == 200
    wait_until(equal_to_the_engine, 10, 0.1, "the proxy's view to equal the sim's cache")
    assert read_state(sim.url)["cached_blocks"] > 0
    assert httpx.post(sim.url + "/reset_prefix_cache").status_code == 200
    wait_until(lambda: equal_to_the_engine() and kv_view(fleet.url, "sim-0")["blocks"] == 0, 10, 0.1,
               "the proxy's view to empty with the sim's cache")
    assert kv_view(fleet.url, "sim-0")["resyncs"] == 0


async def test_a_lost_report_makes_the_proxy_ask_and_the_worker_resend_everything(procs, tmp_path):
    fleet = Fleet(procs, tmp_path)
    await asyncio.to_thread(fleet.start_proxy)
    mirror = KvMirror(SCHEME.algo, SCHEME.seed, BLOCK, capacity_blocks=1000)
    registration = WorkerRegistration(worker_id="w1", url="http://127.0.0.1:9", models=["m1"], engine="sim",
                                      kv_capacity_tokens=16000)
    reporter = ProxyReporter(fleet.url, registration, lambda: _load(), interval_s=0.05, kv_events=mirror)

    def blocks() -> float | None:
        return kv_view(fleet.url, "w1").get("blocks")

    await reporter.start()
    try:
        mirror.stored([1, 2, 3])
        await asyncio.to_thread(wait_until, lambda: blocks() == 3, 10, 0.05, "the first blocks at the proxy")
        mirror.stored([4])
        mirror.take_batch()  # a batch that never reached the proxy (the report carrying it was lost)
        mirror.stored([5])
        await asyncio.to_thread(wait_until, lambda: blocks() == 5, 10, 0.05,
                                "the proxy to ask for a snapshot and get every block")
        assert mirror.stats["snapshots"] >= 2
    finally:
        await reporter.stop()


async def _load() -> Load:
    return Load(0.1, 0, 0, kv_capacity_tokens=16000)
