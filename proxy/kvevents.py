"""The KV-event batch a worker sends inside its load report: which blocks its engine's prefix cache gained and lost.

Owns the batch's shape and the packing of block hashes (base64 of big-endian 64-bit ints: 10.7 characters a
block against ~20 as JSON numbers, and one C call to unpack). Workers import it too, so, like protocol.py, it
imports nothing else from the proxy. Who builds batches: backends/kv_mirror.py; who applies them:
proxy/routing/engine_blocks.py. Why they ride in the report: docs/design/kv-events.md.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Collection

from pydantic import BaseModel, ConfigDict, Field

# A batch names at most this many blocks (stored and removed together): 12 MB of base64, under the proxy's
# default body limit. A worker whose engine holds more sends its snapshot capped (marked incomplete).
MAX_BATCH_BLOCKS = 1 << 20
_B64_CHARS = (MAX_BATCH_BLOCKS * 8 + 2) // 3 * 4


def pack_hashes(hashes: Collection[int]) -> str:
    """Block hashes (unsigned 64-bit) as the batch carries them."""
    if not hashes:
        return ""
    return base64.b64encode(struct.pack(f">{len(hashes)}Q", *hashes)).decode("ascii")


def unpack_hashes(packed: str) -> tuple[int, ...]:
    """The block hashes in a packed string; ValueError when it is not whole 64-bit ints in base64."""
    if not packed:
        return ()
    try:
        raw = base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64: {exc}") from None
    if len(raw) % 8:
        raise ValueError("not a whole number of 64-bit block hashes")
    return struct.unpack(f">{len(raw) // 8}Q", raw)


class KvEventBatch(BaseModel):
    """Changes to one engine's cached blocks since the worker's previous batch, or (`snapshot`) all of them.

    `seq` counts the batches of one boot of the worker (its registration's boot_id): a receiver that sees a
    number skipped has lost changes and waits for a snapshot (it asks in its answer to the report). Within a
    batch, `cleared` applies first, then `removed`, then `stored`; a block is named once per batch.
    """

    model_config = ConfigDict(extra="forbid")

    seq: int = Field(..., ge=0, le=2**63 - 1)
    snapshot: bool = Field(False, description="`stored` is every block the engine holds: replace, do not add")
    cleared: bool = Field(False, description="the engine dropped every block (AllBlocksCleared) before these changes")
    complete: bool = Field(True, description="False: the worker missed engine events it could not replay, so "
                                             "blocks cached before then may be missing from its view")
    stored: str = Field("", max_length=_B64_CHARS, description="pack_hashes() of blocks that entered the cache")
    removed: str = Field("", max_length=_B64_CHARS, description="pack_hashes() of blocks that left it")
    # how the engine names blocks; on every snapshot (a receiver keeps them until the next one)
    block_size: int | None = Field(None, ge=1, le=1 << 20)
    hash_algo: str | None = Field(None, max_length=32)
    hash_seed: str | None = Field(None, max_length=256)
    capacity_blocks: int | None = Field(None, ge=1, le=2**40, description="blocks the engine's KV cache has")
