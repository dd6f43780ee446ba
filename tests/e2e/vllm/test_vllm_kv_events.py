"""A real vLLM CPU engine's KV events, read by the worker's own subscriber, against the block hashes the proxy
computes: equal for a text prompt, an image prompt (named by media_ids.py's uuid) and a conversation's next
turn; and what the engine evicts leaves the proxy's view.

The engine is launched with the command line `kvroute worker --engine vllm` builds (VllmAdapter with the
worker's EngineKvFeed endpoints); the worker's subscriber and mirror run in a thread of this process, and the
proxy's side is an EngineBlocks fed with the mirror's batches, as the reports would carry them. Token ids are
the proxy's own (proxy/tokens' counter over the model's tokenizer files, as a worker hands them over), never
the engine's /tokenize. One engine for the module. Through `kvroute worker` and the proxy itself:
tests/e2e/vllm/test_vllm_fleet.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from backends.engines.base import EngineLaunch
from backends.engines.vllm import VllmAdapter
from backends.kv_subscriber import EngineKvFeed
from proxy.kvevents import KvEventBatch
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.routing.block_hash import HashScheme, block_hashes
from proxy.routing.engine_blocks import EngineBlocks
from proxy.routing.media_ids import with_media_uuids
from proxy.tokens.bundle import read_model_dir
from proxy.tokens.counter import PromptCounter
from proxy.tokens.media import media_uuid
from proxy.tokens.prompt import CountedPrompt
from proxy.workers.registry import Registry
from tests.e2e.vllm.test_vllm_fleet import MODEL, MODEL_DIR, png_data_url
from tests.support.procs import KVROUTE, ProcessGroup, free_port, wait_http_ok, wait_until

pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(420),
]

# 8 MiB of KV = 32 blocks of 128 tokens on the tiny model: a few long prompts evict the first ones
ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(8 * 1024 * 1024), "--max-num-seqs", "8",
               "--max-model-len", "2048"]
IMAGE_PAD = 12  # <|image_pad|> in the tiny model's tokenizer


class FeedThread:
    """The worker's EngineKvFeed, run on an event loop of its own thread; reads go through that loop."""

    def __init__(self, feed: EngineKvFeed) -> None:
        self.feed = feed
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(feed.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def held(self) -> set[int]:
        async def read() -> set[int]:
            return set(self.feed.mirror._copies)
        return self.call(read())

    def batch(self) -> KvEventBatch | None:
        async def take() -> KvEventBatch | None:
            return self.feed.mirror.take_batch()
        return self.call(take())

    def close(self) -> None:
        self.call(self.feed.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Engine:
    url: str
    feed: FeedThread
    scheme: HashScheme
    registry: Registry
    blocks: EngineBlocks
    counter: PromptCounter
    reports: int = 0

    def prompt(self, messages: list[dict]) -> CountedPrompt:
        """The prompt's token ids (and media spans) as the proxy counts them."""
        counted = self.counter.count({"messages": messages}, True)
        assert counted is not None
        return counted

    def chat(self, messages: list[dict], max_tokens: int = 2) -> list[int]:
        """Serve `messages`; the prompt's token ids as the proxy counts them (the engine counted as many)."""
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        resp = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        counted = self.prompt(messages)
        assert counted.num_tokens == resp.json()["usage"]["prompt_tokens"]
        return counted.token_ids

    def report(self) -> None:
        """What the worker's next load report would carry, taken by the proxy's side."""
        self.reports += 1
        self.registry.record_report("w", LoadReport(
            worker_id="w", url="http://w:1", models=[MODEL], kv_cache_usage=0.0, kv_capacity_tokens=4096,
            num_running=0, num_waiting=0, seq=self.reports, boot_id="b", kv_events=self.feed.batch()))


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    group = ProcessGroup(tmp_path_factory.mktemp("vllm-kv-events"))
    feed: FeedThread | None = None
    try:
        if not (MODEL_DIR / "config.json").exists():
            build = group.start([*KVROUTE, "make-tiny-model", str(MODEL_DIR)], name="make-tiny-model")
            assert build.popen.wait(180) == 0, build.log()
        adapter = VllmAdapter()
        launch = EngineLaunch(model=str(MODEL_DIR), served_model_name=MODEL, host="127.0.0.1", port=free_port(),
                              device="cpu", engine_args=list(ENGINE_ARGS))
        env = adapter.environment(launch, os.environ)
        scheme = adapter.kv_event_scheme(launch, env)
        assert scheme == ("sha256_cbor", env.get("PYTHONHASHSEED") or "vllm-none-hash")
        feed = FeedThread(EngineKvFeed(*scheme))
        launch.kv_events = feed.feed.engine_config()
        group.start(adapter.command(launch), name="vllm", env=env)
        url = f"http://127.0.0.1:{launch.port}"
        wait_http_ok(url + "/v1/models", timeout=300)
        registry, blocks = Registry(), EngineBlocks()
        registry.add_listener(blocks.on_registry_event)
        registry.register(WorkerRegistration(worker_id="w", url="http://w:1", models=[MODEL], boot_id="b"))
        block_size = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', httpx.get(url + "/metrics").text)
        assert block_size is not None
        bundle = read_model_dir(MODEL_DIR)
        assert bundle is not None
        yield Engine(url, feed, HashScheme(int(block_size.group(1)), *scheme), registry, blocks, PromptCounter(bundle))
    except Exception:
        print(group.logs())
        raise
    finally:
        if feed is not None:
            feed.close()
        group.stop_all()


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def stored(engine: Engine, hashes: list[int]) -> set[int]:
    """Wait until the engine's events named all of `hashes`; what the worker's copy holds then."""
    return wait_until(lambda: (lambda held: held if set(hashes) <= held else None)(engine.feed.held()), 20, 0.1,
                      f"BlockStored for {len(hashes)} blocks")


def test_a_text_prompts_blocks_are_named_by_the_engine_as_the_proxy_names_them(engine):
    tokens = engine.chat([{"role": "system", "content": words("rule", 120)}, {"role": "user", "content": "hi"}])
    hashes = block_hashes(engine.scheme, tokens)
    assert len(hashes) >= 3
    stored(engine, hashes)
    engine.report()
    assert engine.blocks.view("w").exact
    assert engine.blocks.match(hashes) == {"w": len(hashes)}


def test_an_image_named_by_its_content_hash_is_keyed_by_the_engine_as_the_proxy_keys_it(engine):
    image = png_data_url(160, 96, (10, 200, 90))
    payload = with_media_uuids({"messages": [{"role": "user", "content": [
        {"type": "text", "text": words("look", 70)}, {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": words("describe", 120)}]}]})
    assert payload is not None
    part = payload["messages"][0]["content"][1]
    tokens = engine.chat(payload["messages"])
    (item,) = engine.prompt(payload["messages"]).media
    pads = [i for i, t in enumerate(tokens) if t == IMAGE_PAD]
    assert (item.offset, item.length) == (pads[0], len(pads)) and part["uuid"] == media_uuid(item.url)
    media = [(part["uuid"], item.offset, item.length)]
    hashes = block_hashes(engine.scheme, tokens, media)
    first_image_block = pads[0] // engine.scheme.block_size
    assert len(hashes) > first_image_block + 1  # the image's block and one after it
    stored(engine, hashes)
    engine.report()
    assert engine.blocks.match(hashes) == {"w": len(hashes)}
    # named otherwise (vLLM's own pixel hash, which the proxy cannot compute), the image's blocks differ
    unnamed = block_hashes(engine.scheme, tokens, [("another-name", pads[0], len(pads))])
    assert engine.blocks.match(unnamed) == {"w": first_image_block}


def test_a_conversations_next_turn_finds_the_turn_before_in_the_engines_cache(engine):
    first = [{"role": "system", "content": words("persona", 110)}, {"role": "user", "content": words("ask", 30)}]
    first_tokens = engine.chat(first)
    stored(engine, block_hashes(engine.scheme, first_tokens))
    second = first + [{"role": "assistant", "content": "noted"}, {"role": "user", "content": words("more", 120)}]
    engine.report()
    second_tokens = engine.prompt(second).token_ids
    hashes = block_hashes(engine.scheme, second_tokens)
    common = next((i for i, (a, b) in enumerate(zip(first_tokens, second_tokens, strict=False)) if a != b),
                  len(first_tokens))
    # before it is sent: the proxy already sees the blocks the two turns share
    assert engine.blocks.match(hashes) == {"w": common // engine.scheme.block_size}
    assert engine.chat(second) == second_tokens
    stored(engine, hashes)
    engine.report()
    assert engine.blocks.match(hashes) == {"w": len(hashes)}


def test_what_the_engine_evicts_leaves_the_proxys_view(engine):
    tokens = engine.chat([{"role": "user", "content": words("evictme", 200)}])
    hashes = block_hashes(engine.scheme, tokens)
    stored(engine, hashes)
    engine.report()
    assert engine.blocks.match(hashes) == {"w": len(hashes)}
    for i in range(5):  # 5 prompts of ~1000 tokens through a 32-block cache
        engine.chat([{"role": "user", "content": words(f"flood{i}x", 250)}])
    wait_until(lambda: not set(hashes) & engine.feed.held(), 20, 0.1, "BlockRemoved for the first prompt")
    engine.report()
    assert engine.blocks.match(hashes) == {}
    assert engine.blocks.view("w").exact and len(engine.blocks.view("w").blocks) <= 32
