"""Disaggregated models: which models have prefill, decode or encode workers, and the policy that decides each of
their requests with proxy/routing/disagg.py: whole on one worker, or prefill on one and decode on another, images
encoded on an encode worker first; and which models have a flexible pool (both workers with two-way connectors:
proxy/routing/flexible.py decides theirs).

Owns the decision's inputs (each candidate's queue as kv_cost predicts it, its cached prefix from the prefix index,
the estimator's learnt rates, the images each encoder was recently given, the link between the pools), the
shortlist above `disagg.shortlist_above` candidates, the Decision with its StagePlan, and what each stage teaches
the estimator. Not the arithmetic (disagg.py) nor the bytes (proxy/dataplane/stages.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from proxy.pools import link as link_preset
from proxy.request import CHAT, RoutedRequest
from proxy.routing.base import Decision, Policy, PolicyDeps
from proxy.routing.disagg import LinkView, Plan, RequestView, WorkerView, plan, view_of
from proxy.routing.kv_cost import predict
from proxy.routing.live import LiveConfig
from proxy.routing.prediction import KvCostPrediction
from proxy.routing.stage_plan import ENCODE, PREFILL, Stage, StagePlan
from proxy.routing_config import DisaggConfig, PolicyKnobs
from proxy.workers.registry import Registry, Worker, WorkerState

log = logging.getLogger("kvroute.routing.split")

SPLIT_ROLES = frozenset({"prefill", "decode", "encode"})

# What crosses the link per token when the workers do not say (their `kv_bytes_per_token` and
# `encoder_bytes_per_token` labels; the sim gives them): Qwen3-VL-8B in bf16, 2 x 36 layers x 8 KV heads x 128,
# and its vision output, hidden 4096 x 2 bytes x 4 feature levels.
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2
DEFAULT_ENCODER_BYTES_PER_TOKEN = 2 * 4096 * 4
ENCODER_MEMORY = 4096  # images remembered per encode worker (most recent first out): its cache holds about as many
MEDIA_SAMPLE_CHARS = 4096  # a large data URL is hashed by its length, head and tail (as proxy/request.py does)


def media_hashes(payload: dict[str, Any], kind: str) -> tuple[str, ...]:
    """Content hashes of a chat request's images and videos, in order: the encoder caches' keys."""
    if kind != CHAT:
        return ()
    out = []
    for message in payload.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind_of = part.get("type", "text") if isinstance(part, dict) else "text"
            if kind_of == "text" or not isinstance(kind_of, str):
                continue
            value = part.get(kind_of)
            locator = value.get("url") if isinstance(value, dict) else value
            text = locator if isinstance(locator, str) else repr(value)
            hasher = hashlib.blake2b(digest_size=16)
            if len(text) > 2 * MEDIA_SAMPLE_CHARS:
                hasher.update(b"%d:" % len(text))
                hasher.update(text[:MEDIA_SAMPLE_CHARS].encode())
                hasher.update(text[-MEDIA_SAMPLE_CHARS:].encode())
            else:
                hasher.update(text.encode())
            out.append(hasher.hexdigest())
    return tuple(out)


def flexible_worker(worker: Worker) -> bool:
    """A both worker whose KV connector both sends and receives: it may prefill for another or decode for one."""
    labels = worker.labels
    return worker.role == "both" and bool(labels.get("kv_connector")) and labels.get("kv_role") == "kv_both"


class EncoderMemory:
    """The images each encode worker was recently given: what its encoder cache most likely holds."""

    def __init__(self, per_worker: int = ENCODER_MEMORY) -> None:
        self.per_worker = per_worker
        self._by_worker: dict[str, OrderedDict[str, None]] = {}

    def remember(self, worker_id: str, hashes: Iterable[str]) -> None:
        seen = self._by_worker.setdefault(worker_id, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.per_worker:
            seen.popitem(last=False)

    def held(self, worker_id: str, hashes: Sequence[str]) -> frozenset[str]:
        """Which of `hashes` the worker was given lately."""
        seen = self._by_worker.get(worker_id)
        return frozenset(h for h in hashes if h in seen) if seen else frozenset()

    def forget(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)


class PrefillPressure:
    """Per worker, the seconds of stall its recent prefills caused each decoding request, per second: a counter that
    decays with time constant `window_s` (pressure(W) in disagg.py's decode(W))."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._by_worker: dict[str, tuple[float, float]] = {}  # worker -> (decayed stall seconds, as of when)

    def add(self, worker_id: str, stall_s: float, now: float) -> None:
        if stall_s > 0:
            self._by_worker[worker_id] = (self._decayed(worker_id, now) + stall_s, now)

    def rate(self, worker_id: str, now: float) -> float:
        return self._decayed(worker_id, now) / self.window_s

    def _decayed(self, worker_id: str, now: float) -> float:
        value, at = self._by_worker.get(worker_id, (0.0, now))
        return value * math.exp(-(now - at) / self.window_s) if now > at else value

    def forget(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)


class SplitFleet:
    """The disaggregated models of the registry, one SplitPolicy each, their encode workers and their link."""

    def __init__(self, live: LiveConfig, registry: Registry) -> None:
        self.live = live
        self.registry = registry
        self.memory = EncoderMemory()
        self.pressure = PrefillPressure(DisaggConfig().pressure_window_s)  # kept with whole_on_prefill; window: config
        self.models: frozenset[str] = frozenset()  # served names with a worker of role prefill, decode or encode
        self.flexible: frozenset[str] = frozenset()  # other served names with 2+ flexible_worker()s (flexible.py)
        self._encoders: dict[str, list[Worker]] = {}
        self._labels: dict[str, dict[str, str]] = {}  # per model: a generating worker's labels (its connector)
        self._policies: dict[str, SplitPolicy] = {}
        registry.add_listener(self._on_registry_event)
        live.follow(self._follow)
        self._rescan()

    def _on_registry_event(self, kind: str, worker: Worker, detail: Any) -> None:
        if kind in ("register", "remove"):
            if kind == "remove":
                self.memory.forget(worker.worker_id)
                self.pressure.forget(worker.worker_id)
            self._rescan()

    def _rescan(self) -> None:
        models: set[str] = set()
        encoders: dict[str, list[Worker]] = {}
        labels: dict[str, dict[str, str]] = {}
        flexible: dict[str, int] = {}
        for worker in self.registry.workers():
            if worker.role in SPLIT_ROLES:
                models.update(worker.models)
            elif flexible_worker(worker):
                for model in worker.models:
                    flexible[model] = flexible.get(model, 0) + 1
            for model in worker.models:
                if worker.role == "encode":
                    encoders.setdefault(model, []).append(worker)
                elif worker.labels:
                    labels.setdefault(model, worker.labels)
        self.models, self._encoders, self._labels = frozenset(models), encoders, labels
        self.flexible = frozenset(m for m, n in flexible.items() if n > 1 and m not in models)
        for gone in set(self._policies) - models:
            del self._policies[gone]

    def knobs_for(self, model: str) -> PolicyKnobs:
        config = self.live.config
        configured = config.model(model)
        return config.proxy.routing.for_model(configured.routing if configured is not None else None)

    def _follow(self, live: LiveConfig) -> None:
        for model, policy in self._policies.items():
            knobs = self.knobs_for(model)
            if policy.knobs != knobs:
                policy.configure(knobs)

    def policy_for(self, served: str) -> SplitPolicy | None:
        """The policy of a disaggregated model; None for any other (its configured policy serves it)."""
        if served not in self.models:
            return None
        policy = self._policies.get(served)
        deps = self.live.policies.deps
        if policy is None or policy.deps is not deps:
            policy = self._policies[served] = SplitPolicy(deps, self.knobs_for(served), self, served)
        return policy

    def encoders(self, model: str, now: float) -> list[Worker]:
        """The model's encode workers that take work now."""
        return [w for w in self._encoders.get(model, ()) if w.state(now) is WorkerState.READY]

    def link(self, model: str) -> LinkView:
        """The network between the model's pools: the config's `kv_transfer.link`, else what its workers say."""
        configured = self.live.config.model(model)
        labels = self._labels.get(model, {})
        name = (configured.kv_transfer.link if configured is not None and configured.kv_transfer is not None
                else labels.get("kv_link", "rdma-400g"))
        try:
            over = link_preset(name)
        except KeyError:
            over = link_preset("rdma-400g")
        return LinkView.of(over, _number(labels.get("kv_bytes_per_token"), DEFAULT_KV_BYTES_PER_TOKEN),
                           _number(labels.get("encoder_bytes_per_token"), DEFAULT_ENCODER_BYTES_PER_TOKEN))


def _number(value: str | None, default: float) -> float:
    try:
        parsed = float(value) if value is not None else default
    except ValueError:
        return default
    return parsed if parsed > 0 else default


class SplitPolicy(Policy):
    """Plans a disaggregated model's requests (the module docstring); one per model, made by SplitFleet."""

    name = "disagg"
    config: DisaggConfig

    def __init__(self, deps: PolicyDeps, knobs: PolicyKnobs, fleet: SplitFleet, model: str) -> None:
        self.fleet = fleet
        self.model = model
        super().__init__(deps, knobs)

    def configure(self, knobs: PolicyKnobs) -> None:
        super().configure(knobs)
        self.config = knobs.disagg
        self.fleet.pressure.window_s = knobs.disagg.pressure_window_s

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        deps = self.deps
        estimator, index = deps.estimator, deps.prefix_index
        depths = index.match(request.prefix_hashes, None, now) if request.prefix_hashes else {}
        pool = self._shortlist(candidates, depths)
        encoders = self.fleet.encoders(self.model, now) if request.media_tokens else []
        media = media_hashes(request.payload, request.kind) if encoders else ()
        snapshots = [w.load.snapshot(now) for w in pool]
        fleet_waiting = max(s.reported_waiting for s in snapshots)
        hot = index.hot_by_worker()
        prefix_tokens, output = request.prefix_tokens, request.expected_output_tokens
        whole_on_prefill = self.config.whole_on_prefill
        views: list[WorkerView] = []
        cached_of: dict[str, int] = {}
        for w, snap in zip(pool, snapshots, strict=True):
            wid = w.worker_id
            model = estimator.for_worker(wid)
            depth = depths.get(wid, 0)
            cached = cached_of[wid] = prefix_tokens[depth - 1] if depth else 0
            queue_s = predict(w, model, request, cached, hot.get(wid, 0), now, fleet_waiting).queue_s
            pressure = self.fleet.pressure.rate(wid, now) if whole_on_prefill else 0.0
            views.append(view_of(wid, w.role, snap, model, queue_s, cached, output, pressure=pressure))
        for e in encoders:
            model = estimator.for_worker(e.worker_id)
            bias, _, s_vis = model.params()
            views.append(WorkerView(e.worker_id, "encode", queue_s=e.load.in_flight * (bias + s_vis * request.media_tokens),
                                    bias_s=bias, s_per_media_token=s_vis,
                                    encoder_cache=self.fleet.memory.held(e.worker_id, media)))
        wanted = RequestView(request.prompt_tokens, request.media_tokens, media, output)
        try:
            explain = log.isEnabledFor(logging.DEBUG)
            chosen = plan(wanted, views, self.fleet.link(self.model), explain=explain, split=self.config.split,
                          whole_on_prefill=whole_on_prefill, slowdown=self.config.stall_cost == "slowdown")
        except ValueError:  # only prefill workers are left: each is a whole engine and answers a whole request
            worker = self.least_in_flight(pool)
            return Decision(worker, "prefill_worker_whole", request.expected_kv_tokens,
                            prefill_tokens=request.prompt_tokens)
        if explain:
            log.debug("model=%s prompt_tokens=%d media_tokens=%d -> %s; terms %s; passed over: %s", request.model,
                      request.prompt_tokens, request.media_tokens, chosen.describe(),
                      " ".join(f"{k}={v:.4g}" for k, v in chosen.terms.items()),
                      "; ".join(f"{label} (cost {cost * 1000:.1f} ms)" for label, cost in chosen.alternatives))
        return self._decision(chosen, pool, encoders, request, media, cached_of)

    def _decision(self, chosen: Plan, pool: Sequence[Worker], encoders: Sequence[Worker], request: RoutedRequest,
                  media: tuple[str, ...], cached: dict[str, int]) -> Decision:
        by_id = {w.worker_id: w for w in (*pool, *encoders)}
        terms = chosen.terms
        estimator = self.deps.estimator
        prompt, output = request.prompt_tokens, request.expected_output_tokens
        encode = Stage(by_id[chosen.encode], 0, 0) if chosen.encode is not None else None
        if chosen.kind == "aggregated":
            worker = by_id[chosen.worker]  # type: ignore[index]
            uncached = int(terms["uncached_tokens"])
            media_uncached = 0 if encode else request.media_tokens * uncached // prompt
            cold = estimator.for_worker(worker.worker_id).prefill_s(prompt, request.media_tokens)
            prediction = KvCostPrediction(terms["queue_s"], chosen.ttft_s, cold, media_uncached)
            staged = StagePlan(chosen, None, encode, media)  # whole unless encoded elsewhere first
            return Decision(worker, "aggregated", uncached + output, None, uncached, prediction, plan=staged)
        prefill_worker, decoder = by_id[chosen.prefill], by_id[chosen.decode]  # type: ignore[index]
        queue_s = terms["queue_s"]
        uncached = prompt - min(cached.get(prefill_worker.worker_id, 0), max(prompt - 1, 0))
        cold = estimator.for_worker(prefill_worker.worker_id).prefill_s(prompt, request.media_tokens)
        prefill = Stage(prefill_worker, prompt, uncached, queue_s)
        moved = int(terms["moved_tokens"])
        prediction = KvCostPrediction(queue_s, chosen.ttft_s, cold, 0 if encode else request.media_tokens)
        return Decision(decoder, "split", moved + output, None, 0, prediction,
                        plan=StagePlan(chosen, prefill, encode, media))

    def _shortlist(self, candidates: Sequence[Worker], depths: dict[str, int]) -> Sequence[Worker]:
        """Every candidate up to `shortlist_above`; else `shortlist` random ones of each role plus the holders of
        the request's prefix (as kv_cost's shortlist, per role: a split needs one of each)."""
        config = self.config
        if len(candidates) <= config.shortlist_above:
            return candidates
        rng = self.deps.rng
        by_role: dict[str, list[Worker]] = {}
        for w in candidates:
            by_role.setdefault(w.role, []).append(w)
        chosen: dict[str, Worker] = {}
        for workers in by_role.values():
            for w in rng.sample(workers, min(config.shortlist, len(workers))):
                chosen[w.worker_id] = w
        if depths:
            for w in candidates:
                if w.worker_id in depths:
                    chosen[w.worker_id] = w
        return list(chosen.values())

    # --- accounting hooks ------------------------------------------------------------------
    def on_dispatch(self, decision: Decision, request: RoutedRequest, now: float) -> None:
        wid = decision.worker.worker_id
        if decision.reason == ENCODE:
            if decision.plan is not None:
                self.fleet.memory.remember(wid, decision.plan.media_hashes)
            return
        if request.prefix_hashes:  # a prefill worker keeps the prompt in its prefix cache, a decoder once pulled
            self.deps.prefix_index.insert(request.prefix_hashes, wid, now, request.prefix_tokens)
        model = self.deps.estimator.for_worker(wid)
        model.observe_dispatch(decision.prefill_tokens, decision.kv_tokens)
        if decision.prefill_tokens and self.config.whole_on_prefill:  # what it will stall each decoding request
            _, s_tok, s_vis = model.params()
            media = decision.prediction.uncached_media_tokens if decision.prediction is not None else 0
            self.fleet.pressure.add(wid, s_tok * decision.prefill_tokens + s_vis * media - model.decode_step_s, now)

    def on_finish(self, decision: Decision, request: RoutedRequest, sent_at: float, first_byte_at: float | None,
                  ended_at: float) -> None:
        prediction = decision.prediction
        if first_byte_at is None or prediction is None or decision.reason == ENCODE:
            return
        model = self.deps.estimator.for_worker(decision.worker.worker_id)
        share = self.knobs.kv_cost.learn_max_queue_share
        if decision.reason == PREFILL:  # its whole answer is its prefill and one token
            measured = ended_at - sent_at - model.decode_step_s
            if measured > 0 and prediction.queue_s <= share * measured:
                model.observe_prefill(decision.prefill_tokens, prediction.uncached_media_tokens,
                                      measured - prediction.queue_s)
            return
        if not request.stream:  # only a streamed answer's first byte is its first token
            return
        if decision.plan is None or decision.plan.prefill is None:  # computed here: its prefill is measured
            measured = first_byte_at - sent_at
            if prediction.queue_s <= share * measured:
                model.observe_prefill(decision.prefill_tokens, prediction.uncached_media_tokens,
                                      measured - prediction.queue_s)
        model.observe_turnover(ended_at - first_byte_at)


def stage_decision(stage: Stage, reason: str, staged: StagePlan, request: RoutedRequest, media_tokens: int
                   ) -> Decision:
    """The Decision one leg begins and ends with on its own worker (RoutingService.begin/end)."""
    prediction = KvCostPrediction(stage.queue_s, stage.queue_s, 0.0, media_tokens) if reason == PREFILL else None
    return Decision(stage.worker, reason, stage.kv_tokens, prefill_tokens=stage.prefill_tokens,
                    prediction=prediction, plan=staged)
