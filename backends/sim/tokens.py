"""Deterministic token estimates for the sim engine: text, Qwen3-VL images/videos, chat template, filler output.

Owns turning a request body into token ids (and back into filler text); it does not
schedule or cost them. No real tokenizer unless `--tokenizer DIR` gives one (exact_prompt): otherwise the
rules below are an approximation, stable run to run.

Text rule: the text is split into pieces (a word with at most one leading space, a run of digits,
one punctuation mark, one CJK character, or a run of whitespace). A word costs ceil(len/6) tokens
(the leading space included), each digit one token (Qwen splits digits), every other piece one
token. English prose comes out near 1.3 tokens per word, close to Qwen's BPE. Token ids are a
CRC32 of the piece's chunk, so equal text gives equal ids and a shared prefix gives shared ids.

Image rule (Qwen3-VL): 16 px patches merged 2x2, so one token per 32x32 px after resizing each
side to a multiple of 32 with the total kept inside [min_pixels, max_pixels] (Qwen's smart_resize;
defaults from Qwen3-VL's preprocessor_config: 65536 .. 16777216 px). The size is read from the
decoded `data:` URL's header with PIL; an http(s) URL is not fetched and counts as 1280x720.
Video: not decoded; counted as 16 frames of 640x360, 2 frames merged in time (temporal patch 2).
Placeholder token ids are derived from a hash of the media bytes (or URL), so a repeated image
produces the same ids and hits the prefix cache, as vLLM's multimodal hashing does.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import math
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from proxy.routing.media_ids import media_uuid

IM_START, IM_END = 151644, 151645
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
MEDIA_ID_BASE = 1 << 40  # media placeholder ids live above every text id
_TEXT_ID_SPACE = 150_000

PATCH_MERGE_PX = 32
MIN_PIXELS = 65_536
MAX_PIXELS = 16_777_216
DEFAULT_IMAGE_SIZE = (1280, 720)
DEFAULT_VIDEO_FRAMES, DEFAULT_VIDEO_SIZE, VIDEO_TEMPORAL_PATCH = 16, (640, 360), 2

# Tokenizing is most of the sim's CPU per request (py-spy, kv_pressure closed loop: 30% of its samples, the
# engine's steps 9%): texts this long and images are remembered, as a fleet sees the same system prompts,
# images and session histories again and again. On 2 cores a burst of such requests otherwise starved the
# engines' step loops (bench quality's engine lag).
_CACHE_MIN_CHARS = 256
_IMAGE_CACHE_SIZE = 256
_IMAGES: dict[tuple[int, int], tuple[int, int]] = {}

# CJK first: those characters are also \w letters, but Qwen spends about one token on each
_PIECE = re.compile(r"[\u3000-\u9fff\uac00-\ud7af]| ?[^\W\d_\u3000-\u9fff\uac00-\ud7af]+|\d|\s+|[^\w\s]|_")
FILLER_WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "that", "on", "was", "for", "as",
                "with", "by", "at", "from", "this", "an", "be", "model", "image", "cache", "token",
                "route", "fleet", "block", "batch", "queue", "light", "river", "stone", "cloud")


class MediaError(ValueError):
    """A media part the engine cannot read (bad data URL, unknown image format)."""


@dataclass
class Prompt:
    """A request's prompt as the engine sees it."""

    token_ids: list[int]
    media_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, length) of media tokens
    media_keys: list[int] = field(default_factory=list)  # each span's content hash (the encoder cache's key)
    media_ids: list[str] = field(default_factory=list)  # each span's identifier (the part's uuid, else its hash)
    continues: bool = False  # ends inside an open assistant message: the output goes on from its text

    @property
    def num_media_tokens(self) -> int:
        return sum(length for _, length in self.media_spans)


def text_token_ids(text: str) -> list[int]:
    if len(text) >= _CACHE_MIN_CHARS:  # a system prompt, a document, a session's history: seen again and again
        return list(_long_text_ids(text))
    return _text_ids(text)


@functools.lru_cache(maxsize=512)
def _long_text_ids(text: str) -> tuple[int, ...]:
    return tuple(_text_ids(text))


def _text_ids(text: str) -> list[int]:
    ids: list[int] = []
    for piece in _PIECE.findall(text):
        # a word (optionally with its leading space) costs one token per 6 characters; the rest one each
        n = math.ceil(len(piece) / 6) if piece.lstrip(" ").isalpha() and len(piece) > 1 else 1
        for i in range(n):
            ids.append(zlib.crc32(piece[i * 6:(i + 1) * 6].encode()) % _TEXT_ID_SPACE)
    return ids


def count_text_tokens(text: str) -> int:
    return len(text_token_ids(text))


def image_tokens_for_size(width: int, height: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """Qwen's smart_resize, then one token per 32x32 px."""
    f = PATCH_MERGE_PX
    width, height = max(width, 1), max(height, 1)
    h_bar = max(f, round(height / f) * f)
    w_bar = max(f, round(width / f) * f)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(f, math.floor(height / beta / f) * f)
        w_bar = max(f, math.floor(width / beta / f) * f)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / f) * f
        w_bar = math.ceil(width * beta / f) * f
    return (h_bar // f) * (w_bar // f)


def _decode_data_url(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not payload:
        raise MediaError("data URL without a payload")
    if ";base64" not in header:
        return payload.encode()
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"bad base64 in data URL: {exc}") from exc


def _media_key(source: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(source, digest_size=5).digest(), "big")


def image_placeholder(url: str) -> tuple[int, int]:
    """(number of tokens, hash key) of one image URL."""
    key = (len(url), hash(url))  # not the URL itself: a data URL can be megabytes
    found = _IMAGES.get(key)
    if found is None:
        found = _IMAGES[key] = _image_placeholder(url)
        if len(_IMAGES) > _IMAGE_CACHE_SIZE:
            del _IMAGES[next(iter(_IMAGES))]  # the oldest entry
    return found


def _image_placeholder(url: str) -> tuple[int, int]:
    if url.startswith("data:"):
        data = _decode_data_url(url)
        try:
            from PIL import Image  # lazy: PIL is only needed for image requests

            with Image.open(io.BytesIO(data)) as img:  # reads the header only
                width, height = img.size
        except Exception as exc:  # PIL raises many types for bad input
            raise MediaError(f"cannot read image from data URL: {exc}") from exc
        return image_tokens_for_size(width, height), _media_key(data)
    return image_tokens_for_size(*DEFAULT_IMAGE_SIZE), _media_key(url.encode())


def video_placeholder(url: str) -> tuple[int, int]:
    source = _decode_data_url(url) if url.startswith("data:") else url.encode()
    per_frame = image_tokens_for_size(*DEFAULT_VIDEO_SIZE, min_pixels=4096)
    return per_frame * (DEFAULT_VIDEO_FRAMES // VIDEO_TEMPORAL_PATCH), _media_key(source)


@functools.lru_cache(maxsize=256)
def _media_ids(count: int, key: int) -> tuple[int, ...]:
    return tuple(MEDIA_ID_BASE + ((key * 65_537 + i) % MEDIA_ID_BASE) for i in range(count))


def _part_url(part: dict[str, Any], kind: str) -> str:
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f"{kind} part without a url")
    return url


def media_hash(key: int) -> str:
    """A media item's content hash as the sim's kv/ec_transfer_params name it (vLLM's mm_hash plays this part)."""
    return f"{key:010x}"


def _append_content(content: Any, ids: list[int], spans: list[tuple[int, int]], keys: list[int],
                    names: list[str]) -> None:
    if content is None:
        return
    if isinstance(content, str):
        ids.extend(text_token_ids(content))
        return
    if not isinstance(content, list):
        raise MediaError("message content must be a string or a list of parts")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            ids.extend(text_token_ids(str(part.get("text", ""))))
        elif kind in ("image_url", "video_url"):
            url = _part_url(part, kind)
            count, key = (image_placeholder if kind == "image_url" else video_placeholder)(url)
            ids.append(VISION_START)
            spans.append((len(ids), count))
            keys.append(key)
            uuid = part.get("uuid")
            names.append(uuid if isinstance(uuid, str) and uuid else media_uuid(url))
            ids.extend(_media_ids(count, key))
            ids.append(VISION_END)
        else:
            raise MediaError(f"unsupported content part type {kind!r}")


def chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> Prompt:
    """Token ids of a Qwen-style chat template: <|im_start|>role\\ncontent<|im_end|>\\n per message.

    With `continue_final_message` the last message stays open (no <|im_end|>): generation goes on from its
    text, as vLLM's continue_final_message does (the caller checks it is an assistant message)."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    keys: list[int] = []
    names: list[str] = []
    newline = text_token_ids("\n")
    for i, message in enumerate(messages):
        ids.append(IM_START)
        ids.extend(text_token_ids(f"{message.get('role', 'user')}\n"))
        _append_content(message.get("content"), ids, spans, keys, names)
        if continue_final_message and i == len(messages) - 1:
            return Prompt(ids, spans, keys, names, continues=bool(message.get("content")))
        ids.append(IM_END)
        ids.extend(newline)
    if add_generation_prompt:
        ids.append(IM_START)
        ids.extend(text_token_ids("assistant\n"))
    return Prompt(ids, spans, keys, names)


def exact_prompt(counter: Any, body: dict[str, Any], chat: bool) -> Prompt | None:
    """The prompt as the model's real tokenizer and chat template count it (the sim's --tokenizer: a
    proxy.tokens PromptCounter), each image's placeholders given ids from its content as above; None where that
    counter cannot count it (then the rule above applies)."""
    from proxy.tokens.counter import Uncountable

    try:
        counted = counter.count(body, chat)
    except Uncountable:
        return None
    ids = list(counted.token_ids)
    spans = []
    for item in counted.media:
        ids[item.offset:item.offset + item.length] = _media_ids(item.length, _media_key(item.url.encode()))
        spans.append((item.offset, item.length))
    messages = body.get("messages") or [{}]
    continues = chat and body.get("continue_final_message") is True and bool(messages[-1].get("content"))
    return Prompt(ids, spans, continues=continues)


def completion_prompt(prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, list):
        return Prompt([int(t) for t in prompt])
    return Prompt(text_token_ids(prompt))


def public_token_ids(ids: list[int]) -> list[int]:
    """Ids as a client sees them (/tokenize): media placeholders show as Qwen's image pad id."""
    return [IMAGE_PAD if t >= MEDIA_ID_BASE else t for t in ids]


class FillerText:
    """Deterministic output: one short word (one token by the text rule) per generated token."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def next_piece(self, first: bool) -> tuple[str, int]:
        word = self._rng.choice(FILLER_WORDS)
        piece = word.capitalize() if first else f" {word}"
        return piece, text_token_ids(piece)[0]
