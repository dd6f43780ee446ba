"""Parsing a client body into routing features: validation, prefix chains, token estimates."""

from __future__ import annotations

import base64
import io

import orjson
import pytest
from PIL import Image

from proxy.errors import ProxyError
from proxy.request import CHAT, COMPLETIONS, TOKENS_PER_MEDIA_FRAME, image_size_from_data_url, parse_request


def chat(messages, **extra) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **extra})


def png_data_url(width: int, height: int, color=(200, 10, 10), fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format=fmt)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "model"),
    (orjson.dumps({"model": "m"}), "messages"),
    (orjson.dumps({"model": "m", "messages": []}), "messages"),
    (orjson.dumps({"model": "m", "messages": [{"content": "x"}]}), "messages[0]"),
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}), "stream"),
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}), "max_tokens"),
])
def test_malformed_chat_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(ProxyError) as info:
        parse_request(body, CHAT)
    assert info.value.status == 400
    assert info.value.param == param


def test_completions_need_a_prompt():
    with pytest.raises(ProxyError):
        parse_request(orjson.dumps({"model": "m"}), COMPLETIONS)
    for prompt in ("hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        routed = parse_request(orjson.dumps({"model": "m", "prompt": prompt}), COMPLETIONS)
        assert routed.prefix_hashes and routed.prompt_tokens >= 1


def test_original_bytes_are_kept_and_features_extracted():
    body = chat([{"role": "user", "content": "hi"}], stream=True, max_tokens=7, user="alice")
    routed = parse_request(body, CHAT)
    assert routed.body is body
    assert routed.stream is True and routed.model == "m"
    assert routed.expected_output_tokens == 7
    assert routed.session_key == "alice"
    assert parse_request(body, CHAT, session_header="s-1").session_key == "s-1"
    assert routed.body_for_model("m") is body
    assert orjson.loads(routed.body_for_model("served"))["model"] == "served"


def test_a_shared_system_prompt_shares_its_prefix_hashes():
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    a = parse_request(chat([system, {"role": "user", "content": "What is 2+2?"}]), CHAT)
    b = parse_request(chat([system, {"role": "user", "content": "Name a colour."}]), CHAT)
    shared = 0
    while shared < min(len(a.prefix_hashes), len(b.prefix_hashes)) and a.prefix_hashes[shared] == b.prefix_hashes[shared]:
        shared += 1
    assert shared >= 8  # the ~1200-byte system prompt spans 9 blocks of 128 bytes
    assert a.prefix_hashes[-1] != b.prefix_hashes[-1]
    assert 220 <= a.prefix_tokens[shared - 1] <= 260  # 40 x 6 Qwen tokens: You| are| a| careful| assistant|.


def test_the_same_image_with_different_questions_matches_up_to_the_image():
    url = png_data_url(320, 320)
    a = parse_request(chat(image_message(url, "what is this?")), CHAT)
    b = parse_request(chat(image_message(url, "describe the colours")), CHAT)
    other = parse_request(chat(image_message(png_data_url(320, 320, (0, 0, 255)), "what is this?")), CHAT)
    assert a.prefix_hashes[0] == b.prefix_hashes[0]
    assert a.prefix_hashes[0] != other.prefix_hashes[0]
    # 320x320 px at 32x32 px per token = 100 image tokens, and they count as cached tokens
    assert a.prefix_tokens[0] >= 100
    assert a.media_count == 1


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_image_size_is_read_from_the_header(fmt):
    assert image_size_from_data_url(png_data_url(640, 480, fmt=fmt)) == (640, 480)


def test_image_tokens_follow_qwen3_vl_32px_per_token_with_clamps():
    def tokens(w, h):
        return parse_request(chat(image_message(png_data_url(w, h), "")), CHAT).prompt_tokens

    # the image's own tokens past <|vision_start|> and <|vision_end|>
    base = parse_request(chat([{"role": "user", "content": ""}]), CHAT).prompt_tokens + TOKENS_PER_MEDIA_FRAME
    assert tokens(640, 480) - base == 300          # 20 x 15
    assert tokens(32, 32) - base == 64             # clamped up to Qwen's minimum
    http = parse_request(chat(image_message("http://example.com/cat.png", "")), CHAT).prompt_tokens
    assert http - base == 1024                     # unknown size: assumed ~1024x1024


def test_large_images_are_told_apart_without_hashing_every_byte():
    import os

    def noisy_png() -> str:
        image = Image.frombytes("RGB", (512, 512), os.urandom(512 * 512 * 3))  # incompressible: a large file
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    first, second = noisy_png(), noisy_png()
    assert len(first) > 500_000
    a = parse_request(chat(image_message(first, "q")), CHAT)
    again = parse_request(chat(image_message(first, "other q")), CHAT)
    b = parse_request(chat(image_message(second, "q")), CHAT)
    assert a.prefix_hashes[0] == again.prefix_hashes[0] != b.prefix_hashes[0]
    assert a.prompt_tokens >= 256  # 512x512 px read from the header
