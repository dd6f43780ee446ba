"""How many of a request's prompt tokens each worker has cached: what the cache-aware policies ask.

Owns the choice of source per worker: for a worker whose engine publishes KV events (an exact view in
engine_blocks.py) and a request whose token ids the proxy knows, the engine's own blocks, matched on the
block hashes vLLM would compute (block_hash.py); for every other worker or request, the approximate prefix
index (prefix_index.py). It decides nothing and does no I/O.

Between a dispatch and the engine's events about it lie a report interval and the prefill: a prompt sent to
a worker within RECENT_S counts as cached there too, so a burst of one prefix is not spread over the fleet
before the first of it is stored (vllm-router's kv_aware policy inserts such guesses into its index too).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from proxy.request import RoutedRequest
from proxy.routing.block_hash import HashScheme, block_hashes
from proxy.routing.engine_blocks import EngineBlocks
from proxy.routing.prefix_index import PrefixIndex

RECENT_S = 5.0
RECENT_MAX_BLOCKS = 8192
# A prompt is hashed for at most this many blocks (131k tokens at vLLM's GPU block size of 16): the cost of a
# decision stays bounded whatever the prompt's length.
MAX_REQUEST_BLOCKS = 8192


class CachedPrefix:
    """`match(request, worker_ids, now) -> {worker: cached prompt tokens}`, and `insert` once a request is sent."""

    def __init__(self, approximate: PrefixIndex, exact: EngineBlocks, recent_s: float = RECENT_S) -> None:
        self.approximate = approximate
        self.exact = exact
        self.recent = PrefixIndex(max_blocks=RECENT_MAX_BLOCKS, ttl_s=recent_s)
        self._memo: tuple[RoutedRequest | None, HashScheme | None, list[int]] = (None, None, [])
        # the last match's exact part: (request, workers with an exact view asked about, their cached tokens)
        self._exact_memo: tuple[RoutedRequest | None, set[str], dict[str, int]] = (None, set(), {})

    def match(self, request: RoutedRequest, worker_ids: Collection[str] | None, now: float) -> dict[str, int]:
        """For each worker (among `worker_ids`; None: any) with some of the prompt cached, how many tokens."""
        cached: dict[str, int] = {}
        exact_ids: set[str] = set()
        schemes = self.exact.exact_by_scheme()
        # token ids are counted on first use (proxy/tokens): only where some engine's exact view can use them
        if schemes and request.token_ids is not None and request.media_spans is not None:
            for scheme, ids in schemes.items():
                wanted = ids if worker_ids is None else ids.intersection(worker_ids)
                if not wanted:
                    continue
                exact_ids.update(wanted)
                size = scheme.block_size
                for wid, depth in self.exact.match(self.block_hashes(request, scheme), wanted).items():
                    cached[wid] = depth * size
            self._exact_memo = (request, exact_ids, dict(cached))
        prefix_hashes = request.prefix_hashes
        if not prefix_hashes:
            return cached
        prefix_tokens = request.prefix_tokens
        if exact_ids:
            # the estimate as is, not rounded to the engine's whole blocks: that lowered the engines' hit rate twice
            # (docs/design/kv_aware.md, "Small caches under pressure")
            for wid, depth in self.recent.match(prefix_hashes, exact_ids, now).items():
                if prefix_tokens[depth - 1] > cached.get(wid, 0):
                    cached[wid] = prefix_tokens[depth - 1]
            others = None if worker_ids is None else {w for w in worker_ids if w not in exact_ids}
        else:
            others = worker_ids
        if others is None or others:
            for wid, depth in self.approximate.match(prefix_hashes, others, now).items():
                if wid not in exact_ids:
                    cached[wid] = prefix_tokens[depth - 1]
        return cached

    def exact_part(self, request: RoutedRequest, worker_id: str) -> int | None:
        """Of the prompt, the tokens `worker_id`'s engine holds as its own KV events say (recent dispatches not
        counted); None when its view is not exact or the request's token ids are unknown. Answered from the last
        match() when it was about this request (a decision asks just before), else looked up."""
        last, asked, cached = self._exact_memo
        if last is request and worker_id in asked:
            return cached.get(worker_id, 0)
        view = self.exact.view(worker_id)
        if view is None or not view.exact or request.media_spans is None or request.token_ids is None:
            return None
        assert view.scheme is not None
        depth = self.exact.match(self.block_hashes(request, view.scheme), (worker_id,)).get(worker_id, 0)
        return depth * view.scheme.block_size

    def insert(self, request: RoutedRequest, worker_id: str, now: float) -> None:
        """`request` was sent to `worker_id`: both indexes learn it."""
        if request.prefix_hashes:
            self.approximate.insert(request.prefix_hashes, worker_id, now, request.prefix_tokens)
            if self.exact.exact_by_scheme() and request.token_ids is not None:  # only exact views read it
                self.recent.insert(request.prefix_hashes, worker_id, now, request.prefix_tokens)

    def block_hashes(self, request: RoutedRequest, scheme: HashScheme) -> Sequence[int]:
        """The request's blocks as an engine with `scheme` names them (the last request's are kept: a decision
        and its retries ask again)."""
        last, last_scheme, hashes = self._memo
        if last is request and last_scheme == scheme:
            return hashes
        token_ids = request.token_ids or ()
        # vLLM leaves at least the prompt's last token to compute: a prompt never hits its own last block
        usable = min((len(token_ids) - 1) // scheme.block_size, MAX_REQUEST_BLOCKS)
        salt = request.payload.get("cache_salt")
        hashes = block_hashes(scheme, token_ids, request.media_spans or (), salt if isinstance(salt, str) else None,
                              max_blocks=usable) if usable > 0 else []
        self._memo = (request, scheme, hashes)
        return hashes
