"""The proxy's tokenizers, one per served model, and counting a request with its model's.

Owns which tokenizer each model uses (workers hand them over, proxy/api/tokenizers.py; content-addressed by
sha256, so the N workers of a model send it once), their bound (MAX_TOKENIZERS loaded at once, one per model
id; a bundle's own caps are bundle.py's), loading them off the event loop, and when a request is counted:

- at once, before routing, when the count can matter now: an estimate of EXACT_FROM_TOKENS or more (the KV
  projection and prefill backlog of a long prompt), or a prompt that might reach the smallest max_model_len of
  the model's workers (only an exact count may refuse it). Rendering moves to a thread for bodies of
  PREPARE_OFF_LOOP_BYTES or more, encoding for PREPARE_OFF_LOOP_CHARS or more characters not in the cache;
- otherwise on first use (`RoutedRequest.tokens.counted`): a short prompt routes on its estimate, as before.

Any failure to count leaves the request as it was: estimated, never refused on that estimate. So does a
tokenizer found not to count as the model's engines do (`distrust`, from what their answers said:
proxy/routing/cache_feedback.py), until a different one is handed over for the model.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from functools import partial
from typing import Any

from proxy.request import CHAT, RoutedRequest
from proxy.tokens.bundle import BundleError, from_wire
from proxy.tokens.counter import Pending, PromptCounter, Uncountable
from proxy.tokens.prompt import CountedPrompt, PromptTokens
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.tokens")

MAX_TOKENIZERS = 8
# Prompts estimated at this many tokens or more are counted before routing (their count moves the KV projection
# and the prefill backlog by hundreds of tokens); below, the estimate's error is a few tokens.
EXACT_FROM_TOKENS = 1024
# How many tokens a prompt may have for each byte of its request body, at most: byte-level BPE spends at least
# a byte per token, a template adds under a byte per byte of message JSON, and tools' JSON may be re-spaced.
# A prompt whose bound reaches a worker's max_model_len is counted before routing.
TOKENS_PER_BODY_BYTE_BOUND = 2
TEMPLATE_SLACK_TOKENS = 1024
# Above these the work leaves the event loop (bench/results/2026-12-03-exact-tokens-cost.md): encoding costs
# ~0.3 us a character on the 2-core box, so 4096 uncached characters hold the loop ~1.2 ms, against a 51 us
# hop to a thread; rendering a 15 KiB, 41-message conversation in Qwen3's template took 0.25-0.7 ms.
PREPARE_OFF_LOOP_BYTES = 32 * 1024
ENCODE_OFF_LOOP_CHARS = 4096


class TokenizerLimit(ValueError):
    """Holding another tokenizer would pass MAX_TOKENIZERS."""


class TokenizerStore:
    """The tokenizers of one proxy, by model."""

    def __init__(self, registry: Registry | None = None, max_tokenizers: int = MAX_TOKENIZERS) -> None:
        self.max_tokenizers = max_tokenizers
        self._by_model: dict[str, str] = {}
        self._counters: dict[str, PromptCounter] = {}
        self._loading: dict[str, asyncio.Future[PromptCounter]] = {}
        self._registry = registry
        self._limits: dict[str, int | None] = {}  # the smallest max_model_len among a model's workers
        self._warned: set[str] = set()
        self._distrusted: dict[str, str] = {}  # model -> sha256 of the tokenizer its engines' answers contradicted
        if registry is not None:
            registry.add_listener(self._on_registry_event)

    # --- tokenizers -------------------------------------------------------------------------
    def counter(self, model: str) -> PromptCounter | None:
        sha = self._by_model.get(model)
        if sha is None or self._distrusted.get(model) == sha:
            return None
        return self._counters.get(sha)

    def tokenizer_of(self, model: str) -> str | None:
        """sha256 of the tokenizer counting `model`'s prompts now (None: none, or set aside)."""
        sha = self._by_model.get(model)
        return None if sha is None or self._distrusted.get(model) == sha else sha

    def distrust(self, model: str, why: str) -> bool:
        """The engines serving `model` do not count its prompts as its tokenizer here does: count them by
        estimate (never refusing on it) until another tokenizer is handed over. True the first time."""
        sha = self._by_model.get(model)
        if sha is None or self._distrusted.get(model) == sha:
            return False
        self._distrusted[model] = sha
        log.warning("tokenizer %s does not count prompts of %s as its engines do (%s): its prompts are estimated "
                    "and routed on the approximate prefix index until the engines' own tokenizer is handed over",
                    sha[:12], model, why)
        return True

    def distrusted(self) -> dict[str, str]:
        """model -> sha256 of the tokenizer set aside for it."""
        return {m: sha for m, sha in self._distrusted.items() if self._by_model.get(m) == sha}

    def models(self) -> dict[str, str]:
        """model -> sha256 of its tokenizer."""
        return dict(self._by_model)

    async def adopt(self, sha256: str, models: list[str], wire: str | None) -> bool:
        """Use tokenizer `sha256` for `models`, loading it from `wire` if it is new; False when it is new and
        `wire` is None (the caller should send it). Raises BundleError, TokenizerLimit."""
        if sha256 not in self._counters:
            loading = self._loading.get(sha256)
            if loading is None and wire is None:
                return False
            if loading is None:
                self._check_room(sha256, models)
                loading = self._loading[sha256] = asyncio.get_running_loop().create_future()
                try:
                    counter = await asyncio.to_thread(_load, wire, sha256)  # type: ignore[arg-type]
                except Exception as exc:
                    loading.set_exception(exc)
                    loading.exception()  # retrieved: nobody else may be waiting
                    raise
                except BaseException:
                    loading.cancel()
                    raise
                finally:
                    self._loading.pop(sha256, None)
                self._counters[sha256] = counter
                loading.set_result(counter)
            else:
                await asyncio.shield(loading)
        self._check_room(sha256, models)
        for model in models:
            self._by_model[model] = sha256
            if self._distrusted.get(model, sha256) != sha256:  # a different tokenizer: trusted until shown wrong
                del self._distrusted[model]
        in_use = set(self._by_model.values())
        for sha in [s for s in self._counters if s not in in_use]:
            del self._counters[sha]
        return True

    def _check_room(self, sha256: str, models: list[str]) -> None:
        kept = {s for m, s in self._by_model.items() if m not in models} | set(self._loading) | {sha256}
        if len(kept) > self.max_tokenizers:
            raise TokenizerLimit(f"the proxy holds at most {self.max_tokenizers} tokenizers")

    # --- counting a request -----------------------------------------------------------------
    async def count(self, routed: RoutedRequest, served: str) -> None:
        """Give `routed` its exact prompt (`routed.tokens`), counted now when it can matter (see the module
        docstring); then prompt_tokens and media_tokens are the engine's and `exact_tokens` is True."""
        counter = self.counter(served)
        if counter is None:
            return
        chat = routed.kind == CHAT
        tokens = routed.tokens = PromptTokens(partial(self._count_quietly, counter, routed.payload, chat))
        if not self._count_now(routed, served):
            return
        try:
            if len(routed.body) >= PREPARE_OFF_LOOP_BYTES:  # a long conversation: rendering it takes a while too
                pending, encoded = await asyncio.to_thread(_prepare_and_encode, counter, routed.payload, chat)
            else:
                pending = counter.prepare(routed.payload, chat)
                if pending.missing_chars >= ENCODE_OFF_LOOP_CHARS:
                    encoded = await asyncio.to_thread(counter.encode, pending)
                else:
                    encoded = counter.encode(pending)
            counted: CountedPrompt | None = counter.finish(pending, encoded)
        except Uncountable as exc:
            log.debug("prompt for %s left to the engine to count: %s", served, exc)
            counted = None
        except Exception:  # a tokenizer's or template's own failure must not fail the request
            self._warn_once(counter.sha256, served)
            counted = None
        tokens.set(counted)
        if counted is not None:
            use_exact_count(routed, counted)

    def _count_quietly(self, counter: PromptCounter, payload: dict[str, Any], chat: bool) -> CountedPrompt | None:
        try:
            return counter.count(payload, chat)
        except Uncountable:
            return None
        except Exception:
            self._warn_once(counter.sha256, "a prompt counted on use")
            return None

    def _warn_once(self, sha256: str, what: str) -> None:
        if sha256 not in self._warned:
            self._warned.add(sha256)
            log.warning("counting %s with tokenizer %s failed; such prompts keep their estimate", what,
                        sha256[:12], exc_info=True)

    def _count_now(self, routed: RoutedRequest, served: str) -> bool:
        if routed.prompt_tokens >= EXACT_FROM_TOKENS:
            return True
        limit = self._smallest_limit(served)
        bound = TOKENS_PER_BODY_BYTE_BOUND * len(routed.body) + routed.media_tokens + TEMPLATE_SLACK_TOKENS
        return limit is not None and bound >= limit

    def _smallest_limit(self, model: str) -> int | None:
        if model in self._limits:
            return self._limits[model]
        limits = [w.max_model_len for w in (self._registry.workers() if self._registry else ())
                  if w.serves(model) and w.max_model_len]
        limit = self._limits[model] = min(limits) if limits else None  # type: ignore[type-var]
        return limit

    def _on_registry_event(self, kind: str, worker: Worker, detail: Any) -> None:
        if kind in ("register", "remove"):
            for model in worker.models:
                self._limits.pop(model, None)


def use_exact_count(routed: RoutedRequest, counted: CountedPrompt) -> None:
    """Routing features from the engine's own count; the prefix chain's per-block tokens scaled to it."""
    estimate = routed.prompt_tokens
    routed.prompt_tokens = max(1, counted.num_tokens)
    routed.media_tokens = counted.media_tokens
    routed.exact_tokens = True
    if routed.prefix_tokens and estimate > 0 and estimate != routed.prompt_tokens:
        ratio = routed.prompt_tokens / estimate
        routed.prefix_tokens = [int(t * ratio) for t in routed.prefix_tokens]


def _prepare_and_encode(counter: PromptCounter, payload: dict[str, Any], chat: bool) -> tuple[Pending, list[array]]:
    pending = counter.prepare(payload, chat)  # reads the cache only: safe beside the loop's writes
    return pending, counter.encode(pending)


def _load(wire: str, sha256: str) -> PromptCounter:
    bundle = from_wire(wire, sha256)
    try:
        return PromptCounter(bundle)
    except Exception as exc:  # tokenizers raises plain Exception for a tokenizer.json it cannot read
        raise BundleError(f"its tokenizer does not load: {exc}") from None
