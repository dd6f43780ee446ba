"""What each engine really had cached, from its answers: the proxy's predictions checked, and corrected.

Owns, per attempt, what routing believed the chosen worker caches of the prompt (an Expectation, taken just
before the dispatch), and, once the engine's answer says what it really reused (`usage.prompt_tokens_details.
cached_tokens`: vLLM with --enable-prompt-tokens-details, LMDeploy, the sim), three consequences:
- the worker's routing accuracy (CacheAccuracy on Worker.cache_prediction: GET /workers, /metrics);
- for predictions from the approximate prefix index (engines without KV events): an engine that had evicted what
  the index believed makes that worker's older entries stop counting (prefix_index.forget_before: engines evict
  the least recently used first); one that reused more than believed gets those blocks recorded as reused;
- per model, whether the proxy's tokenizer counts as the engines do: answers that contradict its exact count (or
  its block hashes, against an engine whose KV events it follows) systematically end exact counting for the
  model (TokenizerStore.distrust: estimates, never a refusal on them, and the approximate index).
Reading answers is the data plane's (proxy/dataplane/usage.py); deciding is the policies'.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.request import RoutedRequest
from proxy.routing.base import Decision
from proxy.routing.cached_prefix import CachedPrefix
from proxy.routing.tokenizer_store import TokenizerStore
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.cache_feedback")

# An engine reuses whole blocks and never a prompt's last token, and the approximate index counts estimated
# tokens: a difference within this many tokens (or an eighth of the prediction) is rounding, not an eviction.
SLACK_TOKENS = 128
# The tokenizer check: of the last WINDOW answers of a model whose prompt the proxy had counted, at least
# MISMATCH_SHARE (and MIN_ANSWERS) contradicting the count end exact counting for that model.
WINDOW = 16
MIN_ANSWERS = 8
MISMATCH_SHARE = 0.75
# An exact view that found none of a prompt where the engine reused this many blocks more than predicted: the
# proxy does not name the prompt's blocks as the engine does (a race with the engine's events is covered by the
# prediction's recent dispatches).
MISSED_BLOCKS = 2


class AnswerUsage(NamedTuple):
    """What an engine's answer said of its prompt (None: not said)."""

    prompt_tokens: int | None
    cached_tokens: int | None


@dataclass(slots=True)
class Expectation:
    """What routing believed the chosen worker caches of one attempt's prompt, taken before its dispatch."""

    worker: Worker
    model: str                  # the served model
    predicted: int | None       # the decision's cached prompt tokens (None: it did not look)
    prompt_tokens: int          # the prompt as routing counted it
    estimated: bool             # ... by estimate (then so are the prefix index's tokens)
    counted: int | None         # the proxy's exact count of the prompt, where it was counted
    exact: int | None           # of the prompt, what the engine's own KV events showed (None: no exact view used)
    block_size: int             # the exact view's (0 without one)
    deepest_seen: float | None  # approximate index: when its deepest block predicted was last sent to the worker


class CacheAccuracy:
    """One worker's predicted against actual cached tokens, summed over the answers compared."""

    __slots__ = ("answers", "exact_answers", "predicted_tokens", "actual_tokens", "abs_error_tokens", "evicted",
                 "reused", "engine_counts_hits", "last")

    def __init__(self) -> None:
        self.answers = 0
        self.exact_answers = 0        # of which predicted from the engine's own KV events
        self.predicted_tokens = 0
        self.actual_tokens = 0
        self.abs_error_tokens = 0
        self.evicted = 0              # approximate index corrections: the engine had evicted what it believed
        self.reused = 0               # ... the engine had reused more than it believed
        self.engine_counts_hits = False  # some answer reported a cache hit (an engine reporting 0 always may not count)
        self.last: tuple[int, int, str] | None = None

    def add(self, predicted: int, actual: int, source: str) -> None:
        self.answers += 1
        self.exact_answers += source == "exact"
        self.predicted_tokens += predicted
        self.actual_tokens += actual
        self.abs_error_tokens += abs(predicted - actual)
        self.engine_counts_hits = self.engine_counts_hits or actual > 0
        self.last = (predicted, actual, source)

    def to_json(self) -> dict[str, Any]:
        last = self.last
        return {"answers": self.answers, "exact_answers": self.exact_answers,
                "predicted_tokens": self.predicted_tokens, "actual_tokens": self.actual_tokens,
                "mean_abs_error_tokens": round(self.abs_error_tokens / self.answers, 1) if self.answers else None,
                "index_corrections": {"evicted": self.evicted, "reused": self.reused},
                "last": {"predicted": last[0], "actual": last[1], "source": last[2]} if last else None}


class CacheFeedback:
    """`expect` at each dispatch, `observe` with the answer's usage; metrics read `mismatches` and the workers."""

    def __init__(self, registry: Registry, cached_prefix: Callable[[], CachedPrefix], tokenizers: TokenizerStore,
                 served_name: Callable[[str], str]) -> None:
        self._cached_prefix = cached_prefix  # the policies' (read per use: a config edit may rebuild them)
        self.tokenizers = tokenizers
        self._served_name = served_name
        # (model, its tokenizer) -> the last answers: did each contradict that tokenizer?
        self._votes: dict[tuple[str, str], deque[bool]] = {}
        self.mismatches: dict[str, int] = {}      # model -> times its tokenizer was set aside
        registry.add_listener(self._on_registry_event)

    def expect(self, decision: Decision, routed: RoutedRequest, now: float) -> Expectation | None:
        """What `decision` believed of its worker's cache, and the proxy's count of the prompt; None when neither
        is there to check."""
        predicted = decision.cached_tokens
        tokens = routed.tokens
        counted = tokens.counted if tokens is not None and tokens.ready else None  # never counted for this
        if predicted is None and counted is None:
            return None
        worker = decision.worker
        wid = worker.worker_id
        cached_prefix = self._cached_prefix()
        exact = cached_prefix.exact_part(routed, wid) if predicted is not None else None
        block_size = 0
        if exact is not None:
            view = cached_prefix.exact.view(wid)
            block_size = view.scheme.block_size if view is not None and view.scheme is not None else 0
        deepest_seen = None
        if predicted and (exact is None or predicted > exact) and routed.prefix_tokens:
            # the prefix chain's deepest block within the prediction: its stamp is the oldest of them
            depth = bisect_right(routed.prefix_tokens, predicted)
            if depth:
                deepest_seen = cached_prefix.approximate.seen_at(routed.prefix_hashes[depth - 1], wid)
        return Expectation(worker, self._served_name(routed.model), predicted, routed.prompt_tokens,
                           not routed.exact_tokens, counted.num_tokens if counted is not None else None, exact,
                           block_size, deepest_seen)

    def observe(self, expected: Expectation, routed: RoutedRequest, usage: AnswerUsage, now: float) -> None:
        """The engine answered `usage` to the attempt `expected` was taken for."""
        actual = usage.cached_tokens  # None: the engine does not say (vLLM without --enable-prompt-tokens-details)
        predicted = 0
        if expected.predicted is not None and actual is not None and actual >= 0:
            worker = expected.worker
            stats = worker.cache_prediction
            if stats is None:
                stats = worker.cache_prediction = CacheAccuracy()
            predicted = _in_engine_tokens(expected.predicted, expected, usage)
            from_events = expected.exact is not None
            stats.add(predicted, actual, "exact" if from_events else "approximate")
            if not from_events:
                self._correct_index(expected, routed, usage, predicted, actual, stats, now)
        if expected.counted is not None and usage.prompt_tokens is not None:
            self._check_tokenizer(expected, usage, predicted, actual)

    def _correct_index(self, expected: Expectation, routed: RoutedRequest, usage: AnswerUsage, predicted: int,
                       actual: int, stats: CacheAccuracy, now: float) -> None:
        slack = max(SLACK_TOKENS, predicted // 8)
        index = self._cached_prefix().approximate
        wid = expected.worker.worker_id
        if predicted - actual > slack:
            # it had evicted blocks last sent there no earlier than the deepest one predicted: under LRU, all
            # older ones too (this prompt's own were sent again just now, and are held again)
            if stats.engine_counts_hits and expected.deepest_seen is not None:
                index.forget_before(wid, expected.deepest_seen)
                stats.evicted += 1
        elif actual - predicted > slack and routed.prefix_hashes:
            # it had more of the prompt than believed: those blocks are reused there (hot)
            limit = actual
            if expected.estimated and usage.prompt_tokens:
                limit = actual * expected.prompt_tokens / usage.prompt_tokens  # back in the index's units
            depth = bisect_right(routed.prefix_tokens, limit)
            if depth:
                index.insert(routed.prefix_hashes[:depth], wid, now, routed.prefix_tokens)
                stats.reused += 1

    def _check_tokenizer(self, expected: Expectation, usage: AnswerUsage, predicted: int, actual: int | None) -> None:
        model = expected.model
        miscounted = expected.counted != usage.prompt_tokens
        missed = (expected.exact == 0 and expected.block_size > 0 and actual is not None
                  and actual - predicted >= MISSED_BLOCKS * expected.block_size)
        sha = self.tokenizers.tokenizer_of(model)
        if sha is None:
            return  # counted with a tokenizer since set aside: nothing left to judge
        votes = self._votes.get((model, sha))
        if votes is None:
            for key in [k for k in self._votes if k[0] == model]:  # a replaced tokenizer's answers
                del self._votes[key]
            votes = self._votes[model, sha] = deque(maxlen=WINDOW)
        votes.append(miscounted or missed)
        against = sum(votes)
        if len(votes) < MIN_ANSWERS or against < MISMATCH_SHARE * len(votes):
            return
        why = (f"the engine counted {usage.prompt_tokens} prompt tokens where the proxy counted {expected.counted}"
               if miscounted else f"the engine reused {actual} cached tokens where the proxy's block hashes found "
               "none on it")
        del self._votes[model, sha]
        if self.tokenizers.distrust(model, f"{against} of the last {len(votes)} answers contradicted it, the "
                                           f"last: {why}"):
            self.mismatches[model] = self.mismatches.get(model, 0) + 1

    def _on_registry_event(self, kind: str, worker: Worker, detail: object) -> None:
        if kind == "remove":
            self._cached_prefix().approximate.forget_worker(worker.worker_id)


def _in_engine_tokens(predicted: int, expected: Expectation, usage: AnswerUsage) -> int:
    """The prediction in the engine's tokens: an exact view's already are; the prefix index's estimates are scaled
    by the engine's count of the whole prompt. Never the whole prompt (an engine computes its last token)."""
    prompt = usage.prompt_tokens
    if expected.exact is None or predicted > expected.exact:
        if expected.estimated and prompt and expected.prompt_tokens:
            predicted = round(predicted * prompt / expected.prompt_tokens)
    if prompt:
        predicted = min(predicted, prompt - 1)
    return max(0, predicted)
