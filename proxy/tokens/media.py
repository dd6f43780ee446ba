"""Media facts the proxy reads without decoding: an image's size from its file header, a media item's hash.

Owns the header readers (PNG, GIF, JPEG, WebP) and the content hash a media item is known by; what an image
costs in tokens is vision.py's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

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


MEDIA_UUID_PREFIX = "kvr-"


def media_uuid(url: str) -> str:
    """kvroute's name for the media item inline in `url`, given to vLLM as the content part's `uuid` so that
    it keys the item's KV blocks (and encoder cache) by it: equal bytes, equal name."""
    return MEDIA_UUID_PREFIX + content_hash(url)[:32]


def content_hash(url: str) -> str:
    """sha256 of a media item's URL: a data: URL is its content, an http(s) URL names it. Exact, not sampled:
    engines given it as the item's id reuse what they cached under it."""
    return hashlib.sha256(url.encode()).hexdigest()
