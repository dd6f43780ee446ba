"""Each inline image goes to the engine named by its content (proxy/routing/media_ids.py), so the engine keys its
KV blocks as the proxy does; tests/e2e/vllm/test_vllm_kv_events.py checks that vLLM takes the name."""

from __future__ import annotations

import copy

import orjson

from proxy.request import CHAT, parse_request
from proxy.routing.media_ids import body_with_media_uuids, media_uuid, part_identifier, with_media_uuids

PNG = "data:image/png;base64,iVBORw0KGgo="
OTHER = "data:image/png;base64,iVBORw0KGgp="


def chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}


def test_inline_images_get_their_content_hash_as_uuid_and_nothing_else_changes():
    payload = chat({"type": "image_url", "image_url": {"url": PNG}},
                   {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                   {"type": "image_url", "image_url": {"url": OTHER}, "uuid": "caller-named"})
    before = copy.deepcopy(payload)
    out = with_media_uuids(payload)
    assert payload == before  # the original (and its bytes) stay as the client sent them
    parts = out["messages"][1]["content"]
    assert parts[1]["uuid"] == media_uuid(PNG) != media_uuid(OTHER)
    assert "uuid" not in parts[2]  # an http(s) image keeps vLLM's own content hash
    assert parts[3]["uuid"] == "caller-named"
    assert out["messages"][0] is payload["messages"][0]  # untouched messages are not copied
    assert [part_identifier(p) for p in parts[1:]] == [media_uuid(PNG), None, "caller-named"]


def test_a_request_without_inline_media_goes_as_the_client_sent_it():
    body = orjson.dumps(chat({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}))
    routed = parse_request(body, CHAT)
    assert with_media_uuids(routed.payload) is None
    assert body_with_media_uuids(routed, "m") is body


def test_the_rewritten_body_names_the_served_model():
    routed = parse_request(orjson.dumps(chat({"type": "image_url", "image_url": {"url": PNG}})), CHAT)
    sent = orjson.loads(body_with_media_uuids(routed, "served-name"))
    assert sent["model"] == "served-name"
    assert sent["messages"][1]["content"][1]["uuid"] == media_uuid(PNG)
