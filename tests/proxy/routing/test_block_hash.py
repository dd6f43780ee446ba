"""The proxy names a prompt's KV blocks as vLLM does (proxy/routing/block_hash.py).

Checked against what a real vLLM 0.32 CPU engine published (tests/data/vllm_kv_events.json, recorded; the live
check is tests/e2e/vllm/test_vllm_kv_events.py), and against vLLM's rules for extra keys where the recording has
no example (an image spanning blocks, a cache salt).
"""

from __future__ import annotations

import json
from pathlib import Path

from proxy.routing.block_hash import (
    DEFAULT_SEED,
    HashScheme,
    MediaSpan,
    block_digests,
    block_hashes,
    mm_extra_keys,
)

RECORDED = json.loads((Path(__file__).parents[2] / "data" / "vllm_kv_events.json").read_text())


def _image_span(tokens: list[int]) -> MediaSpan:
    pads = [i for i, t in enumerate(tokens) if t == RECORDED["image_pad_id"]]
    assert pads == list(range(pads[0], pads[0] + len(pads)))
    return MediaSpan(RECORDED["image_uuid"], pads[0], len(pads))


def test_a_text_prompt_hashes_to_the_blocks_vllm_stored():
    scheme = HashScheme(RECORDED["block_size"], RECORDED["hash_algo"])
    stored = RECORDED["events"][0]
    assert stored["parent_block_hash"] is None
    assert block_hashes(scheme, RECORDED["prompts"]["text"]) == stored["block_hashes"]


def test_an_image_prompt_hashes_with_the_items_uuid_as_vllm_did():
    scheme = HashScheme(RECORDED["block_size"], RECORDED["hash_algo"])
    tokens = RECORDED["prompts"]["image"]
    span = _image_span(tokens)
    stored = RECORDED["events"][1]
    assert block_hashes(scheme, tokens, [span]) == stored["block_hashes"]
    # the image's block carries the key vLLM published for it: (uuid, offset in the block)
    block = span.offset // scheme.block_size
    assert stored["extra_keys"][block] == [[span.identifier, span.offset - block * scheme.block_size]]
    # without its identifier the image's block (and every block after it) would be named otherwise
    plain = block_hashes(scheme, tokens)
    assert plain[:block] == stored["block_hashes"][:block] and plain[block] != stored["block_hashes"][block]


def test_a_conversations_next_turn_extends_the_chain_of_the_turn_before():
    scheme = HashScheme(RECORDED["block_size"], RECORDED["hash_algo"])
    first, later = RECORDED["events"][0], RECORDED["events"][2]
    hashes = block_hashes(scheme, RECORDED["prompts"]["multi"])
    assert hashes[:len(first["block_hashes"])] == first["block_hashes"]  # the cached turn: the same blocks
    assert later["parent_block_hash"] == first["block_hashes"][-1]
    assert hashes[len(first["block_hashes"]):] == later["block_hashes"]  # what the engine stored new


def test_an_item_spanning_blocks_is_keyed_in_each_at_its_offset_from_that_blocks_start():
    media = [MediaSpan("a", 10, 30), MediaSpan("b", 40, 2)]  # block size 16: a covers blocks 0-2, b block 2
    assert mm_extra_keys(media, 0, 16, 0) == ([("mm", "a", 10)], 0)
    assert mm_extra_keys(media, 16, 32, 0) == ([("mm", "a", -6)], 0)
    assert mm_extra_keys(media, 32, 48, 0) == ([("mm", "a", -22), ("mm", "b", 8)], 2)
    assert mm_extra_keys(media, 48, 64, 2) == ([], 2)


def test_the_seed_the_salt_and_the_block_size_each_change_every_name():
    tokens = list(range(100))
    base = block_hashes(HashScheme(16), tokens)
    assert len(base) == 6 and len(set(base)) == 6
    assert set(block_hashes(HashScheme(16, seed="42"), tokens)).isdisjoint(base)
    salted = block_hashes(HashScheme(16), tokens, cache_salt="tenant-1")
    assert set(salted).isdisjoint(base)  # the salt keys the first block, and the chain carries it on
    assert block_hashes(HashScheme(16, seed=DEFAULT_SEED), tokens) == base


def test_a_grown_prompt_extends_its_known_digests_to_the_same_chain():
    scheme = HashScheme(16)
    tokens = list(range(90))
    known = block_digests(scheme, tokens[:40])
    assert len(known) == 2
    assert block_digests(scheme, tokens, known=known) == block_digests(scheme, tokens)
