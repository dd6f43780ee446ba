"""A served model's tokenizer files as one content-addressed bundle: what a worker hands the proxy.

Owns which files travel (tokenizer, chat template, image/video processor configs, the model config's vision
part), their size caps, the canonical bytes their sha256 names, and the wire form (gzip + base64 in JSON,
unpacked with a bound on the output). Pure data: workers import it too, so it imports nothing of the proxy.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

# The files that decide how a prompt becomes tokens, as a checkpoint folder names them. `engine.json` is
# kvroute's own: what the engine's command line changes (--chat-template, --mm-processor-kwargs).
TOKENIZER_JSON = "tokenizer.json"
ENGINE_JSON = "engine.json"
FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "chat_template.json", "preprocessor_config.json", "processor_config.json",
         "video_preprocessor_config.json", "config.json", ENGINE_JSON)
# Qwen3's tokenizer.json is 11 MiB (the largest common ones, Gemma's, 33 MiB); the rest are a few KiB.
MAX_TOKENIZER_JSON_BYTES = 48 * 1024 * 1024
MAX_OTHER_FILE_BYTES = 1024 * 1024
MAX_BUNDLE_BYTES = MAX_TOKENIZER_JSON_BYTES + len(FILES) * MAX_OTHER_FILE_BYTES
# On the wire: gzip shrinks a tokenizer.json about 4x; base64 grows it by a third.
MAX_WIRE_CHARS = 24 * 1024 * 1024
_MAGIC = b"kvroute-tokenizer-bundle-1\n"


class BundleError(ValueError):
    """A bundle that is malformed, too large, or not what its digest says."""


@dataclass(frozen=True)
class TokenizerBundle:
    files: dict[str, bytes]

    def __post_init__(self) -> None:
        if TOKENIZER_JSON not in self.files:
            raise BundleError(f"a tokenizer bundle needs {TOKENIZER_JSON}")
        for name, data in self.files.items():
            if name not in FILES:
                raise BundleError(f"{name!r} is not a tokenizer file")
            cap = MAX_TOKENIZER_JSON_BYTES if name == TOKENIZER_JSON else MAX_OTHER_FILE_BYTES
            if len(data) > cap:
                raise BundleError(f"{name} is {len(data)} bytes; at most {cap} are accepted")

    def canonical(self) -> bytes:
        """The bytes the digest covers: each file's name, length and bytes, names sorted."""
        parts = [_MAGIC]
        for name in sorted(self.files):
            data = self.files[name]
            parts += [b"%s\n%d\n" % (name.encode(), len(data)), data]
        return b"".join(parts)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    def to_wire(self) -> str:
        """The bundle as the hand-over sends it: gzip, then base64."""
        return base64.b64encode(gzip.compress(self.canonical(), compresslevel=6, mtime=0)).decode()

    def json(self, name: str) -> dict | None:
        """File `name` parsed as a JSON object, or None when absent or not an object."""
        data = self.files.get(name)
        if data is None:
            return None
        try:
            value = json.loads(data)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def text(self, name: str) -> str | None:
        data = self.files.get(name)
        return data.decode("utf-8", errors="replace") if data is not None else None


def from_wire(wire: str, sha256: str) -> TokenizerBundle:
    """The bundle `to_wire` made; BundleError unless it unpacks within the caps and its digest is `sha256`."""
    if len(wire) > MAX_WIRE_CHARS:
        raise BundleError(f"the bundle is {len(wire)} characters on the wire; at most {MAX_WIRE_CHARS}")
    try:
        packed = base64.b64decode(wire, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BundleError(f"the bundle is not base64: {exc}") from None
    raw = _gunzip_bounded(packed, MAX_BUNDLE_BYTES + 4096)
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise BundleError("the bundle's sha256 is not the one it was sent with")
    return TokenizerBundle(_parse_canonical(raw))


def _gunzip_bounded(packed: bytes, limit: int) -> bytes:
    """gzip's content, refusing to produce more than `limit` bytes (a small body must not unpack to gigabytes)."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(packed, limit + 1)
    except zlib.error as exc:
        raise BundleError(f"the bundle is not gzip: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise BundleError(f"the bundle unpacks to more than {limit} bytes")
    if not inflater.eof:
        raise BundleError("the bundle's gzip stream is cut short")
    return out


def _parse_canonical(raw: bytes) -> dict[str, bytes]:
    if not raw.startswith(_MAGIC):
        raise BundleError("not a kvroute tokenizer bundle")
    files: dict[str, bytes] = {}
    i = len(_MAGIC)
    while i < len(raw):
        name_end = raw.find(b"\n", i)
        size_end = raw.find(b"\n", name_end + 1) if name_end >= 0 else -1
        if size_end < 0:
            raise BundleError("the bundle is cut short")
        name = raw[i:name_end].decode("utf-8", errors="replace")
        try:
            size = int(raw[name_end + 1:size_end])
        except ValueError:
            raise BundleError(f"bad length for {name!r}") from None
        start = size_end + 1
        if size < 0 or start + size > len(raw) or name in files:
            raise BundleError(f"bad entry {name!r}")
        files[name] = raw[start:start + size]
        i = start + size
    return files


def read_model_dir(*folders: Path, engine: dict[str, object] | None = None) -> TokenizerBundle | None:
    """The bundle of checkpoint folders `folders` (the tokenizer's first when the engine has one of its own;
    the first folder holding a file wins), None when none has tokenizer.json; `engine`: the engine's own
    overrides, kept as engine.json. Blocking file reads: call it off the event loop."""
    files: dict[str, bytes] = {}
    for name in FILES:
        for folder in folders:
            path = folder / name
            if name != ENGINE_JSON and path.is_file():
                files[name] = path.read_bytes()
                break
    if TOKENIZER_JSON not in files:
        return None
    if engine:
        files[ENGINE_JSON] = json.dumps(engine, sort_keys=True).encode()
    return TokenizerBundle(files)
