"""A prompt as the engine tokenizes it: its token ids, its count, and where each media item sits.

Owns these result types and when they are computed: `PromptTokens` counts at once when routing needs the count
(proxy/routing/tokenizer_store.py decides), else on first use. No tokenizer here: the counting is counter.py's.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from proxy.tokens.media import content_hash


@dataclass(frozen=True)
class MediaItem:
    """One image (or video) of the prompt: its placeholder span in the token ids, and its content hash."""

    kind: str  # "image" | "video"
    url: str = field(repr=False)
    offset: int  # index of its first placeholder token in CountedPrompt.token_ids
    length: int  # its placeholder tokens (what the vision encoder fills)

    @cached_property
    def content_hash(self) -> str:
        """sha256 hex of its URL (the bytes of a data: URL): what an engine may be given as the item's id."""
        return content_hash(self.url)


class CountedPrompt:
    """The engine's view of one prompt. `pieces` are runs of ids; a (token id, n) pair is n copies of it."""

    def __init__(self, pieces: Sequence[array | tuple[int, int]], num_tokens: int,
                 media: Sequence[MediaItem] = (), text_chars: int = 0, max_chars_per_token: int = 0) -> None:
        self.pieces = pieces
        self.num_tokens = num_tokens
        self.media = tuple(media)
        # the rendered prompt's length, and its tokenizer's longest token: vLLM refuses text longer than
        # max_model_len x max_chars_per_token before it tokenizes (limits.py words its refusal the same way)
        self.text_chars = text_chars
        self.max_chars_per_token = max_chars_per_token

    @property
    def media_tokens(self) -> int:
        return sum(item.length for item in self.media)

    @cached_property
    def token_ids(self) -> list[int]:
        """Every prompt token id, media placeholders expanded (built on first use)."""
        ids: list[int] = []
        for piece in self.pieces:
            if isinstance(piece, tuple):
                ids.extend([piece[0]] * piece[1])
            else:
                ids.extend(piece)
        return ids


class PromptTokens:
    """The exact prompt of one request, computed once: now (`set`) or on first use (`counted`)."""

    __slots__ = ("_compute", "_counted", "_done")

    def __init__(self, compute: Callable[[], CountedPrompt | None]) -> None:
        self._compute: Callable[[], CountedPrompt | None] | None = compute
        self._counted: CountedPrompt | None = None
        self._done = False

    @property
    def ready(self) -> bool:
        """Counted already (a later `counted` costs nothing)."""
        return self._done

    @property
    def counted(self) -> CountedPrompt | None:
        """The engine's view of the prompt; None where the proxy cannot know it exactly (an http image, a part type
        or template it does not model). Computed the first time, on the calling thread, which should be the
        event loop's (the counter's cache lives there): a short prompt takes well under a millisecond, and long
        ones were counted off the loop before routing."""
        if not self._done:
            compute, self._compute = self._compute, None
            self.set(compute() if compute is not None else None)
        return self._counted

    def set(self, counted: CountedPrompt | None) -> None:
        self._counted, self._done, self._compute = counted, True, None

    @property
    def token_ids(self) -> list[int] | None:
        counted = self.counted
        return counted.token_ids if counted is not None else None
