"""The routing decisions the data plane asks for: which model a requested name means, which worker takes
a request (admission included), and the accounting around each upstream attempt.

Owns nothing but the seam: admission (proxy/routing/admission.py) holds or sends, the policy chooses (a
disaggregated model's is split.py's SplitPolicy), the registry's load view counts what is in flight,
cache_feedback.py checks each answer's cached tokens against what the decision believed. Bytes, retries and
answers are proxy/dataplane/'s.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from proxy.errors import ProxyError, model_not_found
from proxy.request import RoutedRequest
from proxy.routing.admission import AdmissionController
from proxy.routing.base import Decision, Policy
from proxy.routing.cache_feedback import AnswerUsage, CacheFeedback, Expectation
from proxy.routing.flexible import FlexibleFleet
from proxy.routing.live import LiveConfig
from proxy.routing.split import SplitFleet
from proxy.routing.tokenizer_store import TokenizerStore
from proxy.workers.loadview import Dispatch
from proxy.workers.registry import Registry


@dataclass(slots=True)
class InFlight:
    """One upstream attempt between RoutingService.begin() and RoutingService.end()."""

    decision: Decision
    policy: Policy
    routed: RoutedRequest
    dispatch: Dispatch
    sent_at: float  # time.monotonic()
    expected: Expectation | None = None  # what the decision believed its worker caches of the prompt


class RoutingService:
    """Resolve the model, pick a worker (admission may hold the request), begin and end each attempt."""

    def __init__(self, live: LiveConfig, registry: Registry) -> None:
        self.live = live
        self.registry = registry
        self.admission = AdmissionController(registry, live.proxy, live.policies.deps.estimator)
        self.tokenizers = TokenizerStore(registry)  # each served model's, as its workers hand them over
        self.feedback = CacheFeedback(registry, lambda: live.policies.deps.cached_prefix, self.tokenizers,
                                      self._served_name)
        self.split = SplitFleet(live, registry)  # models with prefill, decode or encode pools
        self.flexible = FlexibleFleet(self.split)  # models whose both workers may prefill for one another
        live.follow(self._follow)

    def _follow(self, live: LiveConfig) -> None:
        self.admission.configure(live.proxy)

    def resolve_model(self, name: str) -> str:
        """The model name workers serve for a requested name or alias; ProxyError 404 if nobody knows it."""
        if self.registry.serves(name):
            return name
        configured = self.live.config.model(name)
        if configured is not None:
            return configured.name
        raise model_not_found(name)

    def _served_name(self, name: str) -> str:
        try:
            return self.resolve_model(name)
        except ProxyError:  # the model left since: the name as asked
            return name

    def policy_for(self, served: str) -> Policy:
        split = self.split
        if split.models and served in split.models:
            return split.policy_for(served)  # type: ignore[return-value]  # not None: a disaggregated model
        if split.flexible and served in split.flexible:
            return self.flexible.policy_for(served, self.live.policies.for_model(served))
        return self.live.policies.for_model(served)

    def pick(self, policy: Policy, routed: RoutedRequest, served: str, tried: set[str],
             first_attempt: bool) -> Coroutine[Any, Any, Decision | None]:
        """Await it: a decision; None when no untried worker is left; ProxyError 400/429/503 when none can take
        it. (Admission's own coroutine, handed over without a frame of its own: it runs per request.)"""
        return self.admission.admit(policy, routed, served, tried, first_attempt)

    def begin(self, decision: Decision, policy: Policy, routed: RoutedRequest, whole: bool = False) -> InFlight:
        """The request goes to decision.worker now: start its accounting. Pass the result to end().
        `whole`: this attempt's answer comes whole whatever the client asked (a split request's prefill)."""
        now = self.registry.clock()
        dispatch = decision.worker.load.start_request(decision.kv_tokens, now, decision.prefill_tokens,
                                                      streamed=routed.stream and not whole)
        expected = self.feedback.expect(decision, routed, now)  # before on_dispatch inserts the prompt
        policy.on_dispatch(decision, routed, now)
        ticket = InFlight(decision, policy, routed, dispatch, time.monotonic(), expected)
        self.admission.wake()  # a released waiter is placed: the next head sees this dispatch
        return ticket

    def first_output(self, ticket: InFlight) -> None:
        """The attempt's first generated output reached the proxy (its prefill is done; with
        admit_after_output, the default, its engine may admit again: the head of a queue may go)."""
        load = ticket.decision.worker.load
        load.first_output(ticket.dispatch)
        if load.rules.admit_after_output or load.rules.admit_after_head:
            self.admission.wake()

    def upstream_head(self, ticket: InFlight) -> None:
        """The engine answered the attempt's head (with the admit_after_head knob: it took the request in,
        so its engine may admit again and the head of a queue may go)."""
        ticket.decision.worker.load.upstream_head(ticket.dispatch)
        self.admission.wake()

    def end(self, ticket: InFlight, first_byte_at: float | None, usage: AnswerUsage | None = None) -> None:
        """One upstream attempt is over, whatever the outcome; call exactly once per begin(). `usage`: what the
        engine's answer said of the prompt, when the proxy read it."""
        ticket.decision.worker.load.finish_request(ticket.dispatch)
        if usage is not None and ticket.expected is not None:
            self.feedback.observe(ticket.expected, ticket.routed, usage, self.registry.clock())
        ticket.policy.on_finish(ticket.decision, ticket.routed, ticket.sent_at, first_byte_at, time.monotonic())
        self.registry.notify_changed()
        self.admission.wake()

    def queue_lengths(self) -> dict[str, int]:
        """Requests held by admission, per model."""
        return self.admission.queue_lengths()
