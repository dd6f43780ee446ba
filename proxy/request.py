"""Parse an OpenAI request body once into the features routing needs.

Owns validation of what the proxy itself relies on (`model`, `stream`, messages/prompt
shape), the prefix hash chain, and the prompt-token estimate; it never changes the body.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.errors import bad_request

# Prefix hashes cover the prompt in blocks of this many bytes (~32 text tokens), and at most
# this many blocks: a longer prompt shares its first 64 KiB with another or not at all.
PREFIX_BLOCK_BYTES = 128
MAX_PREFIX_BLOCKS = 512
# Rough text estimate: English-like text runs about 4 bytes per token in Qwen's BPE.
BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # chat-template framing around each message
# Qwen3-VL: 16 px patches merged 2x2 -> one token per 32x32 pixels, and its image processor
# clamps an image to [64, 16384] tokens (min_pixels 65536, max_pixels 16777216).
PIXELS_PER_IMAGE_TOKEN = 32 * 32
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 64, 16384
UNKNOWN_IMAGE_TOKENS = 1024  # an http image or an unreadable header: assume ~1024x1024
UNKNOWN_VIDEO_TOKENS = 4096
# What a request is expected to generate when it does not say (max_tokens), and a cap so one
# max_tokens=32768 request does not make a worker look full: most answers stop far earlier.
DEFAULT_EXPECTED_OUTPUT_TOKENS = 256
MAX_EXPECTED_OUTPUT_TOKENS = 2048

# Media larger than twice this (in URL characters) is hashed by length, head and tail.
MEDIA_SAMPLE_CHARS = 64 * 1024

CHAT = "chat"
COMPLETIONS = "completions"


@dataclass(slots=True)
class RoutedRequest:
    """One client request as routing sees it; `body` is the exact bytes the client sent."""

    body: bytes
    payload: dict[str, Any]
    kind: str
    model: str
    stream: bool
    prefix_hashes: list[int]
    prefix_tokens: list[int]  # prefix_tokens[i]: estimated prompt tokens covered by prefix_hashes[i]
    prompt_tokens: int
    expected_output_tokens: int
    session_key: str | None = None
    media_count: int = 0
    media_tokens: int = 0  # of prompt_tokens, the image/video tokens (priced with the vision encoder)

    @property
    def expected_kv_tokens(self) -> int:
        """KV tokens this request will hold at its peak: prompt plus what it will generate."""
        return self.prompt_tokens + self.expected_output_tokens

    def body_for_model(self, served_name: str) -> bytes:
        """The body to forward: the original bytes, unless an alias must become the served name."""
        if served_name == self.model:
            return self.body
        return json_bytes({**self.payload, "model": served_name})


def parse_request(body: bytes, kind: str, session_header: str | None = None) -> RoutedRequest:
    """Validate `body` for endpoint `kind` (CHAT or COMPLETIONS) and extract routing features.

    Raises ProxyError(400) for malformed JSON or missing/mistyped fields.
    """
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise bad_request("The request body must be a JSON object.")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", "model")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", "stream")

    chain = _PrefixChain()
    if kind == CHAT:
        text_bytes, media_tokens, media_count = _chat_features(payload, chain)
        framing = TOKENS_PER_MESSAGE * len(payload["messages"])
    else:
        text_bytes, media_tokens, media_count = _completion_features(payload, chain)
        framing = 0
    prompt_tokens = framing + media_tokens + math.ceil(text_bytes / BYTES_PER_TOKEN)

    chain.finish()
    session = session_header or payload.get("user")
    return RoutedRequest(
        body=body, payload=payload, kind=kind, model=model, stream=stream,
        prefix_hashes=chain.hashes, prefix_tokens=chain.cum_tokens, prompt_tokens=max(1, prompt_tokens),
        expected_output_tokens=_expected_output(payload),
        session_key=session if isinstance(session, str) and session else None,
        media_count=media_count, media_tokens=media_tokens,
    )


def _expected_output(payload: dict[str, Any]) -> int:
    param = "max_completion_tokens" if payload.get("max_completion_tokens") is not None else "max_tokens"
    limit = payload.get(param)
    if limit is None:
        limit = DEFAULT_EXPECTED_OUTPUT_TOKENS
    elif not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise bad_request(f"`{param}` must be a non-negative integer.", param)
    n = payload.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise bad_request("`n` must be a positive integer.", "n")
    return min(limit, MAX_EXPECTED_OUTPUT_TOKENS) * n


class _PrefixChain:
    """Chained block hashes over the canonical prompt; media parts stand in as a content hash.

    A block closes at PREFIX_BLOCK_BYTES or right after a media part, so the same image followed
    by a different question still matches up to and including the image. Each block carries
    its estimated tokens (text bytes / 4, or the media's tokens) for overlap-in-tokens maths.
    """

    __slots__ = ("hashes", "cum_tokens", "_buf", "_buf_tokens", "_total", "_hasher")

    def __init__(self) -> None:
        self.hashes: list[int] = []
        self.cum_tokens: list[int] = []
        self._buf = bytearray()
        self._buf_tokens = 0.0
        self._total = 0.0
        self._hasher = hashlib.blake2b(digest_size=8)

    def add_text(self, raw: bytes) -> None:
        view = memoryview(raw)
        i, n = 0, len(raw)
        while i < n and len(self.hashes) < MAX_PREFIX_BLOCKS:
            take = min(PREFIX_BLOCK_BYTES - len(self._buf), n - i)
            self._buf += view[i:i + take]
            self._buf_tokens += take / BYTES_PER_TOKEN
            i += take
            if len(self._buf) >= PREFIX_BLOCK_BYTES:
                self._close_block()

    def add_media(self, kind: str, locator: str, tokens: int) -> None:
        # A data: URL is the content itself; an http URL names it. Either way equal media hash equal.
        # A large one is identified by its length, head and tail: hashing megabytes per request
        # would cost milliseconds, and a rare collision only costs a routing preference.
        hasher = hashlib.blake2b(digest_size=16)
        if len(locator) > 2 * MEDIA_SAMPLE_CHARS:
            hasher.update(b"%d:" % len(locator))
            hasher.update(locator[:MEDIA_SAMPLE_CHARS].encode())
            hasher.update(locator[-MEDIA_SAMPLE_CHARS:].encode())
        else:
            hasher.update(locator.encode())
        digest = hasher.hexdigest()
        self._buf += f"\x00{kind}:{digest}\x00".encode()
        self._buf_tokens += tokens
        self._close_block()

    def finish(self) -> None:
        self._close_block()

    def _close_block(self) -> None:
        if not self._buf or len(self.hashes) >= MAX_PREFIX_BLOCKS:
            return
        self._hasher.update(self._buf)
        self._total += self._buf_tokens
        self.hashes.append(int.from_bytes(self._hasher.copy().digest(), "little"))
        self.cum_tokens.append(int(self._total))
        self._buf.clear()
        self._buf_tokens = 0.0


def _chat_features(payload: dict[str, Any], chain: _PrefixChain) -> tuple[int, int, int]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` is required and must be a non-empty array.", "messages")
    text_bytes = media_tokens = media_count = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"`messages[{i}]` must be an object with a string `role`.", f"messages[{i}]")
        chain.add_text(b"\x00" + message["role"].encode() + b"\x00")
        content = message.get("content")
        if isinstance(content, str):
            raw = content.encode()
            chain.add_text(raw)
            text_bytes += len(raw)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise bad_request(f"`messages[{i}].content` parts must be objects.", f"messages[{i}].content")
                part_type = part.get("type", "text")
                if not isinstance(part_type, str):
                    raise bad_request(f"`messages[{i}].content` part `type` must be a string.",
                                      f"messages[{i}].content")
                if part_type == "text":
                    raw = str(part.get("text", "")).encode()
                    chain.add_text(raw)
                    text_bytes += len(raw)
                else:
                    locator = _media_locator(part, part_type)
                    tokens = _media_tokens(part_type, locator)
                    chain.add_media(part_type, locator, tokens)
                    media_tokens += tokens
                    media_count += 1
        elif content is not None:
            raise bad_request(f"`messages[{i}].content` must be a string or an array.", f"messages[{i}].content")
        for key in ("tool_calls", "name", "tool_call_id"):  # part of the prompt the engine sees
            if key in message:
                raw = json_bytes(message[key])
                chain.add_text(raw)
                text_bytes += len(raw)
    return text_bytes, media_tokens, media_count


def _completion_features(payload: dict[str, Any], chain: _PrefixChain) -> tuple[int, int, int]:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        raw = prompt.encode()
        chain.add_text(raw)
        return len(raw), 0, 0
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            raw = "\x00".join(prompt).encode()
            chain.add_text(raw)
            return len(raw), 0, 0
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            chain.add_text(_hashed_token_bytes(prompt))
            return len(prompt) * BYTES_PER_TOKEN, 0, 0
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            chain.add_text(_hashed_token_bytes(itertools.chain.from_iterable(prompt)))
            return sum(map(len, prompt)) * BYTES_PER_TOKEN, 0, 0
    raise bad_request("`prompt` is required: a string, an array of strings, or token ids.", "prompt")


# The chain reads at most MAX_PREFIX_BLOCKS * PREFIX_BLOCK_BYTES bytes and each id writes at least
# two ("1,"): ids past this many cannot change a hash, so a 10M-id prompt is not formatted whole.
_MAX_HASHED_TOKEN_IDS = MAX_PREFIX_BLOCKS * PREFIX_BLOCK_BYTES // 2 + 1


def _hashed_token_bytes(ids: Iterable[int]) -> bytes:
    return b",".join(b"%d" % t for t in itertools.islice(ids, _MAX_HASHED_TOKEN_IDS))


def _media_locator(part: dict[str, Any], part_type: str) -> str:
    value = part.get(part_type)
    if isinstance(value, dict):
        value = value.get("url")
    if isinstance(value, str):
        return value
    # input_audio and other shapes: their JSON is their identity
    return json_bytes(value).decode()


def json_bytes(value: object) -> bytes:
    """`value` re-encoded; a 400 for what orjson parses but cannot write back (nesting over 255 deep)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise bad_request(f"The request body cannot be re-encoded: {exc}.") from None


def _media_tokens(part_type: str, locator: str) -> int:
    if part_type.startswith("video"):
        return UNKNOWN_VIDEO_TOKENS
    if not part_type.startswith("image"):
        return UNKNOWN_IMAGE_TOKENS // 4
    size = image_size_from_data_url(locator) if locator.startswith("data:") else None
    if size is None:
        return UNKNOWN_IMAGE_TOKENS
    width, height = size
    tokens = math.ceil(width * height / PIXELS_PER_IMAGE_TOKEN)
    return min(max(tokens, MIN_IMAGE_TOKENS), MAX_IMAGE_TOKENS)


# Enough of the base64 payload to reach a JPEG's frame header past typical EXIF blocks.
_HEADER_B64_CHARS = 65536


def image_size_from_data_url(url: str) -> tuple[int, int] | None:
    """(width, height) read from the header of a base64 `data:` image, or None if unknown."""
    comma = url.find(",")
    if comma < 0 or ";base64" not in url[:comma]:
        return None
    chunk = url[comma + 1: comma + 1 + _HEADER_B64_CHARS]
    chunk = chunk[: len(chunk) - len(chunk) % 4]
    try:
        head = base64.b64decode(chunk, validate=False)
    except (binascii.Error, ValueError):
        return None
    return image_size(head)


def image_size(head: bytes) -> tuple[int, int] | None:
    """(width, height) from the first bytes of a PNG, GIF, JPEG or WebP file."""
    if head.startswith(b"\x89PNG\r\n\x1a\n") and len(head) >= 24:
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        return int.from_bytes(head[6:8], "little"), int.from_bytes(head[8:10], "little")
    if head.startswith(b"\xff\xd8"):
        return _jpeg_size(head)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP" and len(head) >= 30:
        fourcc = head[12:16]
        if fourcc == b"VP8X":
            return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
        if fourcc == b"VP8 ":
            return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
        if fourcc == b"VP8L":
            bits = int.from_bytes(head[21:25], "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big")
        i += 2 + length
    return None
