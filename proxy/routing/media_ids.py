"""The identity kvroute gives each inline media item, and the body rewrite that hands it to the engine.

vLLM keys an image's KV blocks by its multimodal hash, which it computes from the decoded pixels unless the
chat request's content part carries a `uuid`; then the uuid is the hash. So the proxy, which cannot decode
pixels on the hot path, names each inline (data: URL) item by a hash of its bytes and puts that name in the
part: engine and proxy then key the item's blocks alike (block_hash.py). Owns that name and the rewrite;
the data plane calls `body_with_media_uuids` where it builds the upstream body (once per request).

Only data: URLs: a name made from an http(s) URL would make vLLM reuse a cached encoding when the content
behind the URL changed; for those the engine hashes the content and the proxy matches no block from the
image on. A part that already has a `uuid` keeps it (the caller's promise that it names that content).
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.request import RoutedRequest
from proxy.tokens.media import media_uuid

MEDIA_PARTS = ("image_url", "video_url")


def part_identifier(part: dict[str, Any]) -> str | None:
    """The identifier vLLM will hash this content part's blocks under, when the proxy can know it: the part's
    `uuid`, else media_uuid() of a data: URL; None for an http(s) URL without a uuid."""
    given = part.get("uuid")
    if isinstance(given, str) and given:
        return given
    url = _url(part)
    return media_uuid(url) if url is not None and url.startswith("data:") else None


def _url(part: dict[str, Any]) -> str | None:
    kind = part.get("type")
    value = part.get(kind) if isinstance(kind, str) and kind in MEDIA_PARTS else None
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) else None


def with_media_uuids(payload: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of a chat payload whose inline media parts without a `uuid` carry media_uuid(); None when no part
    needs one (the original body can go as it is). Copies only the messages and parts it changes."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return None
    new_messages: list[Any] | None = None
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        new_content: list[Any] | None = None
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("uuid") is not None:
                continue
            url = _url(part)
            if url is None or not url.startswith("data:"):
                continue
            if new_content is None:
                new_content = list(content)
            new_content[j] = {**part, "uuid": media_uuid(url)}
        if new_content is not None:
            if new_messages is None:
                new_messages = list(messages)
            new_messages[i] = {**message, "content": new_content}
    return None if new_messages is None else {**payload, "messages": new_messages}


def body_with_media_uuids(routed: RoutedRequest, served_name: str) -> bytes:
    """The upstream body for `served_name` (RoutedRequest.body_for_model), with media uuids added when needed."""
    if not routed.media_count:
        return routed.body_for_model(served_name)
    payload = with_media_uuids(routed.payload)
    if payload is None:
        return routed.body_for_model(served_name)
    if served_name != routed.model:
        payload["model"] = served_name
    return orjson.dumps(payload)
