"""Parse an OpenAI request body once into the features routing needs.

Owns validation of what the proxy itself relies on (`model`, `stream`, messages/prompt
shape), the prefix hash chain, and the prompt-token estimate; it never changes the body.
The exact count, where the model's tokenizer is known, is proxy/tokens/'s (RoutedRequest.tokens).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.errors import bad_request
from proxy.tokens.media import image_size_from_data_url, media_uuid
from proxy.tokens.prompt import PromptTokens

# Prefix hashes cover the prompt in blocks of this many bytes (~32 text tokens), and at most
# this many blocks: a longer prompt shares its first 64 KiB with another or not at all.
PREFIX_BLOCK_BYTES = 128
MAX_PREFIX_BLOCKS = 512
# Chat-template framing (Qwen3-VL's ChatML): `<|im_start|>` role `\n` ... `<|im_end|>` `\n` around each
# message, `<|im_start|>assistant\n` after the last, `<|vision_start|>`/`<|vision_end|>` around each image.
TOKENS_PER_MESSAGE = 5
GENERATION_PROMPT_TOKENS = 3
TOKENS_PER_MEDIA_FRAME = 2
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

# --- text token estimate --------------------------------------------------------------------
# Qwen's BPE (Qwen3 and Qwen3-VL share it) first splits text into letter runs (a word with one
# leading space or symbol), single digits, punctuation runs and blank runs, then merges within
# each. So its token count follows counts of words, digits, symbols and newlines far better than
# bytes do: the weights below are a linear fit to Qwen3's tokenizer on bench/data/token_corpus.jsonl.
# Its error per kind of text, against bytes/4: bench/results/2026-12-01-token-estimate.md.
# 2-byte UTF-8 (accents, Greek, Cyrillic, Arabic) and 4-byte (emoji) were set from a few sentences.
TOKENS_PER_WORD = 1.06  # per run of ASCII letters
_TOKENS_PER_BYTE_OF_CLASS = {
    b"d": 1.23,  # digit: Qwen splits numbers into single digits
    b"p": 0.41,  # ASCII punctuation (runs merge: `"):`, `{"`)
    b"s": 0.06,  # space (mostly inside the next word's token)
    b"n": 1.07,  # newline, tab, CR
}
_TOKENS_PER_WIDE_CHAR = {  # keyed by the class of the UTF-8 lead byte
    b"H": 0.54,  # other 3-byte: CJK ideographs, kana, CJK and fullwidth punctuation
    b"G": 0.89,  # Hangul syllables (lead bytes 0xEA-0xED)
    b"2": 0.50,  # 2-byte: Latin accents, Greek, Cyrillic, Arabic, Hebrew
    b"4": 1.50,  # 4-byte: emoji, rare ideographs
}
# Longer text is estimated from this many evenly spaced windows of this size and scaled, so the
# cost stays bounded (~10 ns a byte, ~0.2 ms at most) however long the prompt.
_SAMPLE_WINDOWS, _SAMPLE_WINDOW_BYTES = 8, 2048


def _byte_classes() -> tuple[bytes, bytes]:
    """translate() tables: each byte -> its class letter above ("o": counted nowhere), and letters -> "a"."""
    classes = bytearray(b"o" * 256)
    letters = bytearray(b" " * 256)
    for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz":
        classes[c] = letters[c] = ord("a")
    for c in b"0123456789":
        classes[c] = ord("d")
    for c in b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~":
        classes[c] = ord("p")
    classes[ord(" ")] = ord("s")
    for c in b"\n\r\t":
        classes[c] = ord("n")
    for lead, cls in ((range(0xC0, 0xE0), "2"), (range(0xE0, 0xF0), "H"), (range(0xEA, 0xEE), "G"),
                      (range(0xF0, 0x100), "4")):
        for c in lead:
            classes[c] = ord(cls)
    return bytes(classes), bytes(letters)


_BYTE_CLASS, _LETTER_RUNS = _byte_classes()


def estimate_text_tokens(raw: bytes) -> float:
    """Qwen3 tokens in UTF-8 text, estimated from counts of word runs and byte classes."""
    n = len(raw)
    if n > _SAMPLE_WINDOWS * _SAMPLE_WINDOW_BYTES:
        step = (n - _SAMPLE_WINDOW_BYTES) // (_SAMPLE_WINDOWS - 1)
        sampled = sum(_count_tokens(raw[i * step:i * step + _SAMPLE_WINDOW_BYTES]) for i in range(_SAMPLE_WINDOWS))
        return sampled * n / (_SAMPLE_WINDOWS * _SAMPLE_WINDOW_BYTES)
    return _count_tokens(raw)


def _count_tokens(raw: bytes) -> float:
    if not raw:
        return 0.0
    runs = raw.translate(_LETTER_RUNS)
    tokens = TOKENS_PER_WORD * (runs.count(b" a") + (runs[0] == 0x61))
    classes = raw.translate(_BYTE_CLASS)
    for cls, weight in _TOKENS_PER_BYTE_OF_CLASS.items():
        tokens += weight * classes.count(cls)
    if not raw.isascii():
        for cls, weight in _TOKENS_PER_WIDE_CHAR.items():
            tokens += weight * classes.count(cls)
    return tokens


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
    # The prompt as the engine tokenizes it, where the model's tokenizer is known (proxy/routing/tokenizer_store.py): counted
    # before routing when the count matters (then exact_tokens, and prompt_tokens/media_tokens are the engine's),
    # else on first use of `tokens.counted`.
    tokens: PromptTokens | None = None
    exact_tokens: bool = False

    @property
    def expected_kv_tokens(self) -> int:
        """KV tokens this request will hold at its peak: prompt plus what it will generate."""
        return self.prompt_tokens + self.expected_output_tokens

    @property
    def media_spans(self) -> list[tuple[str, int, int]] | None:
        """Each media item's (name vLLM keys its KV blocks by, offset, length) within token_ids: the name is the
        `uuid` the proxy gives it (tokens.media.media_uuid of a data: URL); None when one has no name the proxy
        can know (an http(s) URL: the engine names it by the bytes it fetches) or the prompt is not counted."""
        counted = self.tokens.counted if self.tokens is not None else None
        if counted is None:
            return None
        if any(not m.url.startswith("data:") for m in counted.media):
            return None
        return [(media_uuid(m.url), m.offset, m.length) for m in counted.media]

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt's token ids as the engine sees them (media placeholders expanded); None where unknown."""
        return self.tokens.token_ids if self.tokens is not None else None

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
        text_tokens, media_tokens, media_count = _chat_features(payload, chain)
        framing = TOKENS_PER_MESSAGE * len(payload["messages"]) + GENERATION_PROMPT_TOKENS
        framing += TOKENS_PER_MEDIA_FRAME * media_count
    else:
        text_tokens, media_tokens, media_count = _completion_features(payload, chain)
        framing = 0
    prompt_tokens = framing + media_tokens + math.ceil(text_tokens)

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

    def add_text(self, raw: bytes, tokens: float | None = None) -> float:
        """Chain `raw` in; returns the tokens it stands for (`tokens`, else estimate_text_tokens)."""
        if tokens is None:
            tokens = estimate_text_tokens(raw)
        n = len(raw)
        hashes = self.hashes
        if not n or len(hashes) >= MAX_PREFIX_BLOCKS:
            return tokens
        per_byte = tokens / n
        buf = self._buf
        if len(buf) + n < PREFIX_BLOCK_BYTES:  # a short piece (a role, a short message): into the open block
            buf += raw
            self._buf_tokens += n * per_byte
            return tokens
        view = memoryview(raw)
        i = 0
        while i < n and len(hashes) < MAX_PREFIX_BLOCKS:
            room = PREFIX_BLOCK_BYTES - len(buf)
            take = room if room < n - i else n - i
            buf += view[i:i + take]
            self._buf_tokens += take * per_byte
            i += take
            if take == room:
                self._close_block()
        return tokens

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


def _chat_features(payload: dict[str, Any], chain: _PrefixChain) -> tuple[float, int, int]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` is required and must be a non-empty array.", "messages")
    text_tokens = 0.0
    media_tokens = media_count = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"`messages[{i}]` must be an object with a string `role`.", f"messages[{i}]")
        chain.add_text(b"\x00" + message["role"].encode() + b"\x00", tokens=TOKENS_PER_MESSAGE)
        content = message.get("content")
        if isinstance(content, str):
            text_tokens += chain.add_text(content.encode())
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise bad_request(f"`messages[{i}].content` parts must be objects.", f"messages[{i}].content")
                part_type = part.get("type", "text")
                if not isinstance(part_type, str):
                    raise bad_request(f"`messages[{i}].content` part `type` must be a string.",
                                      f"messages[{i}].content")
                if part_type == "text":
                    text_tokens += chain.add_text(str(part.get("text", "")).encode())
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
                text_tokens += chain.add_text(json_bytes(message[key]))
    return text_tokens, media_tokens, media_count


def _completion_features(payload: dict[str, Any], chain: _PrefixChain) -> tuple[float, int, int]:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return chain.add_text(prompt.encode()), 0, 0
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return chain.add_text("\x00".join(prompt).encode()), 0, 0
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):  # token ids: exact
            chain.add_text(_hashed_token_bytes(prompt), tokens=min(len(prompt), _MAX_HASHED_TOKEN_IDS))
            return len(prompt), 0, 0
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            total = sum(map(len, prompt))
            chain.add_text(_hashed_token_bytes(itertools.chain.from_iterable(prompt)),
                           tokens=min(total, _MAX_HASHED_TOKEN_IDS))
            return total, 0, 0
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
