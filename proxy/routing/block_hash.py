"""vLLM's prefix-cache block hashes, computed outside the engine from a prompt's token ids.

Owns the hash scheme (algorithm, NONE_HASH seed, block size) and the hash chain over full blocks, with the
multimodal and cache-salt extra keys, as vllm/v1/core/kv_cache_utils.py builds them; and the 64-bit form in
which vLLM's KV events name a block. It does not tokenize (callers give token ids and media spans) and keeps
no state but a bounded memo. The sim's engine (backends/sim) hashes its blocks with it too.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import cbor2

# What kvroute's workers pin with --prefix-caching-hash-algo: CBOR is the same bytes in every language and
# Python version (pickle's highest protocol may change), and SHA-256 makes NONE_HASH's seed public knowledge
# without weakening the cache (vLLM's own reasoning for its fixed default seed).
DEFAULT_ALGO = "sha256_cbor"
# vLLM's seed for NONE_HASH when PYTHONHASHSEED is unset and the algorithm is a cryptographic one.
DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1
# Equal (parent, block tokens, extra keys) recur across requests (system prompts, a conversation's earlier
# turns): each is hashed once while it stays in this memo.
_MEMO_BLOCKS = 65536


def _sha256_pickle(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


# The algorithms a proxy can reproduce (vLLM's xxhash ones need the xxhash package and a pinned seed).
HASH_FUNCTIONS: dict[str, Callable[[object], bytes]] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


class MediaSpan(NamedTuple):
    """One multimodal item in a prompt: its identifier (vLLM's mm hash, which is the `uuid` a caller gave the
    item) and where its placeholder tokens are. A plain (identifier, offset, length) tuple does as well."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HashScheme:
    """How one engine names its blocks: tokens per block, the hash algorithm and the NONE_HASH seed."""

    block_size: int
    algo: str = DEFAULT_ALGO
    seed: str = DEFAULT_SEED

    @property
    def supported(self) -> bool:
        return self.block_size > 0 and self.algo in HASH_FUNCTIONS


def none_hash(algo: str, seed: str) -> bytes:
    """The parent of every prompt's first block (vLLM's init_none_hash with this seed)."""
    return HASH_FUNCTIONS[algo](seed)


def event_hash(digest: bytes) -> int:
    """A block hash as vLLM's KV events carry it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the low 64 bits)."""
    return int.from_bytes(digest, "big") & _MASK64


@lru_cache(maxsize=_MEMO_BLOCKS)
def _hash_block(algo: str, parent: bytes, tokens: tuple[int, ...], extra: tuple[Any, ...] | None) -> bytes:
    return HASH_FUNCTIONS[algo]((parent, tokens, extra))


@lru_cache(maxsize=64)
def _none_hash(algo: str, seed: str) -> bytes:
    return none_hash(algo, seed)


def mm_extra_keys(media: Sequence[tuple[str, int, int]], start: int, end: int,
                  index: int) -> tuple[list[tuple[Any, ...]], int]:
    """The ("mm", identifier, offset in block) keys of block [start, end) and the next media index to look at
    (vLLM's _gen_mm_extra_hash_keys: `media` sorted by offset; an item spanning blocks is in each of them,
    at a negative offset in the blocks after its first)."""
    keys: list[tuple[Any, ...]] = []
    if not media:
        return keys, index
    _, last_offset, last_length = media[-1]
    if last_offset + last_length <= start:
        return keys, index
    while index < len(media):
        identifier, offset, length = media[index]
        if end <= offset:
            break
        if start >= offset + length:
            index += 1
            continue
        keys.append(("mm", identifier, offset - start))
        if end >= offset + length:
            index += 1
        else:
            break
    return keys, index


def block_digests(scheme: HashScheme, token_ids: Sequence[int], media: Sequence[tuple[str, int, int]] = (),
                  cache_salt: str | None = None, max_blocks: int | None = None,
                  known: list[bytes] | None = None) -> list[bytes]:
    """The full hash of every full block of the prompt, in order (at most `max_blocks`). `known`: the digests of
    its first blocks, computed before (a request that grew): extended in place and returned."""
    size = scheme.block_size
    full = len(token_ids) // size
    if max_blocks is not None:
        full = min(full, max_blocks)
    algo = scheme.algo
    digests = known if known is not None else []
    parent = digests[-1] if digests else _none_hash(algo, scheme.seed)
    index = 0
    for i in range(len(digests), full):
        start = i * size
        end = start + size
        extra: list[Any] = []
        if media:
            extra, index = mm_extra_keys(media, start, end, index)
        if cache_salt and start == 0:
            extra.append(("cache_salt", cache_salt))
        parent = _hash_block(algo, parent, tuple(token_ids[start:end]), tuple(extra) if extra else None)
        digests.append(parent)
    return digests


def block_hashes(scheme: HashScheme, token_ids: Sequence[int], media: Sequence[tuple[str, int, int]] = (),
                 cache_salt: str | None = None, max_blocks: int | None = None) -> list[int]:
    """The prompt's full blocks as vLLM's KV events name them (64-bit ints), in order."""
    return [event_hash(d) for d in block_digests(scheme, token_ids, media, cache_salt, max_blocks)]
