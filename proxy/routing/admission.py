"""Admission: send a request now, or hold it in a per-model FIFO until a worker can start it sooner.

Owns the hold rule, the event-driven queue (no polling), its bounds (429 / 503), and refusing what
fits no worker's context (400); which worker gets a request is the policy's.

A request is held only while every candidate engine is already queueing (WorkerLoad.engine_backlog: it
reported requests waiting, or what was sent to it since has not shown up, see loadview.py); then the first
engine that frees room takes the head of the queue (late binding). A completion, a first output, a report, a
registration, drain or removal re-checks each head; arrivals never pass a waiter. With kv_cost, a request whose
pick is its prefix owner goes to that worker's queue at once, others are held only when predicted to start sooner;
a policy that predicts no times (kv_aware, the default) has each request held then, holders' included, and places
it when an engine frees room (its pick may still be the holder's queue).
`kv_high_water` below 1.0 also holds while every candidate's projected KV usage is at or above it (off by
default). Candidates come from candidates.py's rosters. The rules of engine_backlog are config.yaml's
`proxy.routing.admission`: the controller gives them to every worker's load, at registration and on a config
edit. The rule's derivation and the runs behind each threshold: docs/design/admission.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from proxy.config import ProxyConfig
from proxy.errors import ProxyError, no_healthy_worker
from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.routing.candidates import CandidateIndex, Candidates
from proxy.routing.context_length import context_need, context_refusal
from proxy.routing.estimator import FleetEstimator
from proxy.workers.registry import Registry, Worker

log = logging.getLogger("kvroute.admission")


class _Waiter:
    __slots__ = ("policy", "routed", "served", "tried", "future")

    def __init__(self, policy: Policy, routed: RoutedRequest, served: str, tried: set[str],
                 future: asyncio.Future[Decision | None]) -> None:
        self.policy = policy
        self.routed = routed
        self.served = served
        self.tried = tried
        self.future = future


class AdmissionController:
    """The per-model admission queues of one proxy."""

    def __init__(self, registry: Registry, config: ProxyConfig, estimator: FleetEstimator | None = None) -> None:
        self.registry = registry
        self.config = config
        self.rules = config.routing.admission
        self.estimator = estimator
        self._queues: dict[str, deque[_Waiter]] = {}
        self._waiting = 0
        self.candidate_index = CandidateIndex(registry)
        registry.add_listener(self._on_registry_event)
        for worker in registry.workers():
            worker.load.set_rules(self.rules)

    def configure(self, config: ProxyConfig) -> None:
        """A new config (a live edit): its queue bounds and kv_high_water from the next decision, its admission
        rules in every worker's load view at once (what the loads count is kept); held requests are looked at
        again under them."""
        self.config = config
        if config.routing.admission != self.rules:
            self.rules = config.routing.admission
            for worker in self.registry.workers():
                worker.load.set_rules(self.rules)
            self.wake()

    # --- the decision ------------------------------------------------------------------------
    async def admit(self, policy: Policy, routed: RoutedRequest, served: str, tried: set[str],
                    first_attempt: bool) -> Decision | None:
        """A decision; None when a retry has no untried worker left; ProxyError 400/429/503 otherwise."""
        candidates = self._fitting(served, routed, tried)
        queue = self._queues.get(served)
        if not queue:
            if candidates:
                decision = self._decide(policy, routed, candidates)
                if decision is not None:
                    return decision
            elif tried or not first_attempt:
                return None
            elif self.registry.serves(served):
                raise no_healthy_worker(served)
            # else: a configured model none of whose workers has registered yet: wait for the first
        elif not candidates and tried:
            return None
        return await self._hold(policy, routed, served, tried)

    def _decide(self, policy: Policy, routed: RoutedRequest, candidates: Candidates,
                position: int = 0) -> Decision | None:
        """The policy's pick, or None when holding is predicted to start the request sooner."""
        now = self.registry.clock()
        high_water = self.config.kv_high_water
        if high_water < 1.0:  # (off by default; O(candidates) per decision when on)
            candidates = Candidates.of([w for w in candidates.workers if w.load.projected_kv_usage(now) < high_water])
            if not candidates:
                return None
        if len(candidates) == 1:  # nothing to bind late to: the engine's own queue is as good
            return policy.select_from(candidates, routed, now)
        if candidates.admitting(now):  # some engine admits at once (engine_backlog == 0)
            return policy.select_from(candidates, routed, now)
        # every engine is queueing: bind late, to the first one that frees room, unless sending now
        # is predicted to start it sooner (its prefix owner, say)
        decision = policy.select_from(candidates, routed, now)
        if decision.reason == "prefix_owner":
            return decision  # its owner's queue: a freed worker would prefill it again and evict for it
        prediction = decision.prediction  # kv_cost's; a policy that predicts no times: hold
        if prediction is None:
            return None
        held_s = (position + 1) * self._slot_interval_s(candidates.workers, routed) + prediction.cold_prefill_s
        return decision if prediction.ttft_s <= held_s else None

    def _slot_interval_s(self, candidates: Sequence[Worker], routed: RoutedRequest) -> float:
        """Seconds between two requests finishing somewhere in the fleet (each frees a slot)."""
        rate = 0.0
        for worker in candidates:
            reading = worker.load.reading
            running = reading.num_running if reading is not None else worker.load.in_flight
            if self.estimator is not None:
                turnover = self.estimator.for_worker(worker.worker_id).request_turnover_s(
                    routed.expected_output_tokens)
            else:
                turnover = 1.0
            rate += max(running, 1) / max(turnover, 1e-3)
        return 1.0 / rate if rate > 0 else 0.0

    def _fitting(self, served: str, routed: RoutedRequest, tried: set[str]) -> Candidates:
        """Candidates whose max_model_len holds the request; 400 context_length_exceeded if none does.

        From the candidate index's rosters (no per-worker work); the registry's list is filtered here
        only where the index has no roster to offer (none untried fits, or only stale workers are left).
        """
        needed = context_need(routed)  # 0 unless the prompt was counted exactly: only then is one refused
        found = self.candidate_index.find(served, needed, tried)
        if found is not None:
            return found
        candidates = self.registry.candidates(served, exclude=tried)
        fits = [w for w in candidates if w.max_model_len is None or needed <= w.max_model_len]
        if candidates and not fits:
            raise context_refusal(routed, max(w.max_model_len or 0 for w in candidates))
        return Candidates.of(fits)

    # --- holding -----------------------------------------------------------------------------
    async def _hold(self, policy: Policy, routed: RoutedRequest, served: str, tried: set[str]) -> Decision | None:
        queue_cfg = self.config.queue
        queue = self._queues.setdefault(served, deque())
        if len(queue) >= queue_cfg.max_length:
            raise ProxyError(429, f"Every worker for `{served}` is busy and the admission queue is full "
                                  f"({queue_cfg.max_length}).", "rate_limit_error", code="queue_full",
                             headers={"Retry-After": "1"})
        waiter = _Waiter(policy, routed, served, tried, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        self._waiting += 1
        released = False
        try:
            # the deadline is the only timer: releases come from events (see the module docstring)
            decision = await asyncio.wait_for(asyncio.shield(waiter.future), queue_cfg.max_wait_s)
            released = True
            return decision
        except TimeoutError:
            retry_after = {"Retry-After": str(max(1, round(queue_cfg.max_wait_s / 4)))}
            if not self.registry.serves(served):
                raise ProxyError(503, f"No worker is serving model `{served}` yet (waited "
                                      f"{queue_cfg.max_wait_s:g}s for one to start).", "service_unavailable",
                                 code="no_healthy_worker", headers=retry_after) from None
            raise ProxyError(503, f"Every worker for `{served}` stayed busy for {queue_cfg.max_wait_s:g}s.",
                             "service_unavailable", code="queue_timeout", headers=retry_after) from None
        finally:
            self._waiting -= 1
            try:
                queue.remove(waiter)
            except ValueError:
                pass  # released: already off the queue
            if not released and waiter.future.done() and not waiter.future.cancelled():
                self.wake()  # it was given a worker it will not use: the next one may take it
            elif not waiter.future.done():
                waiter.future.cancel()

    def wake(self) -> None:
        """Something may have freed room: release the head of each queue that can go now."""
        if not self._waiting:
            return
        for queue in self._queues.values():
            while queue:
                head = queue[0]
                if head.future.done():
                    queue.popleft()
                    continue
                try:
                    candidates = self._fitting(head.served, head.routed, head.tried)
                except ProxyError as exc:
                    queue.popleft()
                    head.future.set_exception(exc)
                    continue
                if not candidates:
                    if head.tried:
                        queue.popleft()
                        head.future.set_result(None)
                        continue
                    break
                decision = self._decide(head.policy, head.routed, candidates)
                if decision is None:
                    break
                queue.popleft()
                head.future.set_result(decision)
                # one per event: the released request's begin() wakes the queue again, so the next
                # head sees that dispatch in the worker's load before it is placed
                break

    def _on_registry_event(self, kind: str, worker: Worker, detail: Any) -> None:
        if kind == "register":
            worker.load.set_rules(self.rules)
        if self.estimator is not None:
            if kind == "report":
                self.estimator.for_worker(worker.worker_id).observe_report(
                    getattr(detail, "prefill_tokens_per_s", None), getattr(detail, "decode_step_s", None))
            elif kind == "remove":
                self.estimator.forget(worker.worker_id)
        self.wake()

    def queue_lengths(self) -> dict[str, int]:
        return {model: len(q) for model, q in self._queues.items()}
