"""Whether and how to split one request across pools: aggregated on one worker, or prefill on P then decode on D,
with encode on E first for images, whichever is predicted to give the first token soonest (with whole_on_prefill:
and to decode quickest) at the least cost to the requests already running. Conditional disaggregation by
predicted time, not by a prompt-length threshold.

Owns the arithmetic of that choice over typed views of the candidates (`view_of` builds one from a registry
worker, its learnt WorkerModel and kv_cost's queue); no I/O, no registry access: split.py builds the views and the
data plane runs the plan (proxy/dataplane/stages.py). Seconds throughout, as kv_cost.py and estimator.py:

    prefill(W)      = bias(W) + s_tok(W) x uncached(W) + s_vis(W) x uncached media(W)    [s_vis: 0 if E encoded]
    aggregated(W)   = queue(W) + prefill(W) + stall(W) + decode(W)           W both or decode (+ prefill: whole_on_prefill)
    split(P, D)     = queue(P) + prefill(P) + stall(P) + transfer(prompt - cached(D)) + admit(D) + step(D) + decode(D)
    encode(E)       = queue(E) + encoder(media not in E's cache) + transfer(encoder output); then the prefill
                      starts at max(encode(E), queue)
    stall(W)        = (prefill work on W - one decode step) x requests decoding on W: each waits that much longer
                      for its next token; a decode step is memory-bound, and a prefill up to a step's worth of
                      work rides in its slack (chunked prefill)
    decode(W)       = with whole_on_prefill (else 0): expected output x step(W) x (1 + pressure(W)), the request's
                      own decode there, its steps as W reports them, stretched by W's later prefills; pressure(W)
                      is the stall W's recent prefills caused per second (split.py measures it), high on a busy
                      prefill worker, so a request runs whole there only when the decoders are slower still
    admit(D)        = KV D lacks for prompt + output / KV it frees per second

The lowest total wins; plans within RESOLUTION_S of the best aggregated one go aggregated (no transfer, fewer
parts). Derivation and the terms' sources: docs/design/disaggregation.md.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass, field
from typing import Literal

from proxy.pools import Link
from proxy.routing.estimator import WorkerModel
from proxy.routing_config import EstimatorConfig
from proxy.workers.loadview import LoadSnapshot

_PRIORS = EstimatorConfig()  # a view's rates before anything was learnt: the estimator's default priors

RESOLUTION_S = 0.005
# A decode worker prefills locally when that is faster. A prefill worker is a whole engine: with whole_on_prefill it
# runs a request whole when its decode there, stretched by the prefills it keeps doing, costs less than a split.
AGGREGATED_ROLES = frozenset({"both", "decode"})
WHOLE_ON_PREFILL_ROLES = frozenset({"both", "decode", "prefill"})
PREFILL_ROLES = frozenset({"prefill"})  # a both worker's own prefill is the aggregated plan
DECODE_ROLES = frozenset({"decode", "both"})


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the decision needs of a request (proxy/request.py's RoutedRequest has each)."""

    prompt_tokens: int
    media_tokens: int = 0
    media_hashes: tuple[str, ...] = ()  # content hashes of its images and videos: the encoder cache's keys
    expected_output_tokens: int = 256


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One candidate as the decision sees it; every rate in seconds, as estimator.WorkerModel learns them."""

    worker_id: str
    role: str  # protocol.WorkerRole
    queue_s: float = 0.0  # predicted wait before its prefill of this request starts (kv_cost.predict().queue_s)
    cached_tokens: int = 0  # this request's prompt tokens in its prefix cache
    bias_s: float = _PRIORS.prior_bias_s
    s_per_token: float = 1.0 / _PRIORS.prior_prefill_tokens_per_s
    s_per_media_token: float = _PRIORS.prior_vision_extra / _PRIORS.prior_prefill_tokens_per_s  # an encoder's rate
    decode_step_s: float = _PRIORS.prior_decode_step_s
    decoding: int = 0  # requests generating there now
    kv_free_tokens: float = math.inf  # KV room after what is committed
    kv_release_tokens_per_s: float = math.inf  # KV its running requests give back per second
    encoder_cache: frozenset[str] = frozenset()  # encode workers: media hashes whose output it holds
    pressure: float = 0.0  # seconds its recent prefills stalled each decoding request, per second (decode(W))
    turnover_s: float = math.inf  # how long a request decodes there after its first token (slowdown weights)

    def decode_s(self, output_tokens: int) -> float:
        """A request's predicted decode here: its steps, stretched by this worker's later prefills."""
        return output_tokens * self.decode_step_s * (1.0 + self.pressure)


@dataclass(frozen=True, slots=True)
class LinkView:
    """The network between pools and what crosses it per token."""

    bytes_per_s: float
    latency_s: float
    kv_bytes_per_token: float  # 2 x layers x KV heads x head dim x dtype bytes
    encoder_bytes_per_token: float = 0.0  # vision output per media token (hidden x 2 bytes x feature levels)

    @classmethod
    def of(cls, link: Link, kv_bytes_per_token: float, encoder_bytes_per_token: float = 0.0) -> LinkView:
        return cls(link.bytes_per_s, link.latency_s, kv_bytes_per_token, encoder_bytes_per_token)

    def kv_seconds(self, tokens: float) -> float:
        return self.latency_s + max(tokens, 0.0) * self.kv_bytes_per_token / self.bytes_per_s

    def encoder_seconds(self, media_tokens: float) -> float:
        return self.latency_s + media_tokens * self.encoder_bytes_per_token / self.bytes_per_s


@dataclass(frozen=True)
class Plan:
    """The decision: `aggregated` on `worker`, or `disaggregated` prefill -> decode; `encode` first when set."""

    kind: Literal["aggregated", "disaggregated"]
    worker: str | None
    prefill: str | None
    decode: str | None
    encode: str | None
    ttft_s: float  # predicted time to the first token
    cost_s: float  # ttft_s + the stall it causes others
    reason: str
    terms: dict[str, float] = field(default_factory=dict)
    alternatives: tuple[tuple[str, float], ...] = ()  # (plan, cost_s) of the others considered, best first

    def describe(self) -> str:
        head = f"encode on {self.encode}, then " if self.encode else ""
        what = (f"aggregated on {self.worker}" if self.kind == "aggregated"
                else f"prefill on {self.prefill}, decode on {self.decode}")
        why = f"{self.reason}; " if self.reason else ""
        return f"{head}{what} ({why}ttft {self.ttft_s * 1000:.1f} ms)"


@dataclass(frozen=True, slots=True)
class _Encode:
    worker: str | None
    seconds: float


@dataclass(frozen=True, slots=True)
class _Prefill:
    worker: WorkerView
    ttft_s: float  # until its last prompt token is computed
    stall_s: float
    encode: str | None
    uncached: int
    stall_cost_s: float  # what the stall counts in the plan's cost: stall_s, or weighted (plan's `slowdown`)


def _rendezvous(key: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest(), "big")


def choose_encoder(request: RequestView, encoders: list[WorkerView], link: LinkView) -> _Encode:
    """The encode worker that hands the request's vision output over soonest: the one holding it in its encoder
    cache, else the least busy; equal ones by the image's content hash, so a repeated image meets its cache."""
    if not encoders or not request.media_tokens or not request.media_hashes:
        return _Encode(None, math.inf)
    per_item = request.media_tokens / len(request.media_hashes)
    scored = []
    for e in encoders:
        missing = sum(per_item for h in request.media_hashes if h not in e.encoder_cache)
        encode = e.bias_s + e.s_per_media_token * missing if missing else 0.0
        scored.append((e.queue_s + encode + link.encoder_seconds(request.media_tokens), e.worker_id))
    best = min(s for s, _ in scored)
    near = [wid for s, wid in scored if s - best < RESOLUTION_S]
    key = request.media_hashes[0]
    chosen = max(near, key=lambda wid: _rendezvous(key, wid))
    return _Encode(chosen, next(s for s, wid in scored if wid == chosen))


def _prefill_on(w: WorkerView, request: RequestView, encode: _Encode, always: bool = False,
                slowdown: bool = False) -> _Prefill:
    # (conditional expressions rather than min/max calls: this runs once per candidate per request)
    prompt, cached = request.prompt_tokens, w.cached_tokens
    if prompt > 1:
        cached = 0 if cached < 0 else prompt - 1 if cached > prompt - 1 else cached  # the last token is computed
    else:
        cached = 0
    uncached = prompt - cached
    media = request.media_tokens * uncached // prompt if request.media_tokens and prompt else 0
    queue = w.queue_s
    text_work = w.bias_s + w.s_per_token * uncached
    vision = w.s_per_media_token * media
    local = queue + text_work + vision
    use_encoder = False
    if encode.worker is not None and media > 0:
        # the prefill waits for the encoder output, which the encoder makes while the request would queue anyway
        remote = (encode.seconds if encode.seconds > queue else queue) + text_work
        use_encoder = always or remote < local
    ttft = remote if use_encoder else local
    work = w.s_per_token * uncached + (0.0 if use_encoder else vision)  # the step's own time (bias) runs anyway
    stall = (work - w.decode_step_s) * w.decoding if work > w.decode_step_s else 0.0
    # slowdown: each stalled stream is slowed by stall / decoding over its turnover, this request by its wait over
    # its own prefill time (ttft - queue); in this request's seconds the stall weighs its prefill time / turnover
    cost = stall * min((ttft - queue) / w.turnover_s, 1.0) if slowdown else stall
    return _Prefill(w, ttft, stall, encode.worker if use_encoder else None, uncached, cost)


def _admit_s(d: WorkerView, need: float) -> float:
    deficit = need - d.kv_free_tokens
    if deficit <= 0:
        return 0.0
    return deficit / d.kv_release_tokens_per_s if d.kv_release_tokens_per_s > 0 else math.inf


def plan(request: RequestView, workers: list[WorkerView], link: LinkView, explain: bool = False,
         split: str = "conditional", whole_on_prefill: bool = False, slowdown: bool = False) -> Plan:
    """The plan with the lowest predicted cost (module docstring); ValueError when no worker can generate.
    `explain`: fill `alternatives` (what the debug decision log shows), at the cost of building their plans.
    `split` "always": the best split whenever a prefill worker is among the candidates, and images encoded on an
    encode worker whenever there is one (fixed E/P/D serving). `whole_on_prefill` (conditional only): prefill workers
    may run a request whole, and every plan counts the request's own decode (decode(W)). `slowdown`: the stall counts
    as the slowdown it causes (each stalled stream's delay over its turnover, against this request's wait over its
    own prefill time) rather than in request-seconds: one long prefill's brief stall of many streams no longer
    outweighs seconds of queueing for the prompt itself."""
    encode = choose_encoder(request, [w for w in workers if w.role == "encode"], link)
    always = split == "always"
    whole_on_prefill = whole_on_prefill and not always
    whole_roles = WHOLE_ON_PREFILL_ROLES if whole_on_prefill else AGGREGATED_ROLES
    output = request.expected_output_tokens if whole_on_prefill else 0  # 0: no decode(W) term
    # options as plain tuples, Plans built for the chosen one and the runners-up only: (cost, 0, on a prefill worker,
    # index, prefill, decode) for an aggregated plan (equal costs: off the prefill pool, which stays free for prefills),
    # (cost, 1, index, decoder, transfer_s, admit_s, moved tokens, ttft, decode) for a split
    aggregated: list[tuple] = []
    best_p: _Prefill | None = None
    for i, w in enumerate(workers):
        if w.role == "encode":
            continue
        p = _prefill_on(w, request, encode, always, slowdown)
        if w.role in whole_roles:
            decode = w.decode_s(output) if output else 0.0
            aggregated.append((p.ttft_s + p.stall_cost_s + decode, 0, w.role in PREFILL_ROLES, i, p, decode))
        if w.role in PREFILL_ROLES and (best_p is None
                                        or p.ttft_s + p.stall_cost_s < best_p.ttft_s + best_p.stall_cost_s):
            best_p = p
    splits: list[tuple] = []
    if best_p is not None:
        prompt, need = request.prompt_tokens, request.prompt_tokens + request.expected_output_tokens
        per_token, latency = link.kv_bytes_per_token / link.bytes_per_s, link.latency_s
        for i, d in enumerate(workers):
            if d.role not in DECODE_ROLES:
                continue
            moved = prompt - d.cached_tokens if d.cached_tokens < prompt else 0
            transfer = latency + moved * per_token
            admit = _admit_s(d, need - d.cached_tokens)
            ttft = best_p.ttft_s + transfer + admit + d.decode_step_s
            decode = d.decode_s(output) if output else 0.0
            splits.append((ttft + best_p.stall_cost_s + decode, 1, i, d, transfer, admit, moved, ttft, decode))
    if not aggregated and not splits:
        raise ValueError("no worker can generate: the candidates need a both or decode worker")
    best_agg = min(aggregated, default=None)
    best_split = min(splits, default=None)
    if always and best_split is not None:
        chosen = best_split
    else:  # within RESOLUTION_S of the best aggregated plan: skip the transfer
        chosen = best_agg if best_split is None or (
            best_agg is not None and best_agg[0] - best_split[0] < RESOLUTION_S) else best_split

    def make(option: tuple, reason: str = "") -> Plan:
        if option[1] == 0:
            p: _Prefill = option[4]
            w = p.worker
            return Plan("aggregated", w.worker_id, None, None, p.encode, p.ttft_s, option[0], reason,
                        {"queue_s": w.queue_s, "prefill_s": p.ttft_s - w.queue_s, "stall_s": p.stall_s,
                         "decode_s": option[5], "cached_tokens": w.cached_tokens, "uncached_tokens": p.uncached,
                         "decoding": w.decoding, "on_prefill_worker": float(w.role in PREFILL_ROLES)})
        assert best_p is not None
        d, transfer, admit, moved, ttft, decode = option[3:]
        return Plan("disaggregated", None, best_p.worker.worker_id, d.worker_id, best_p.encode, ttft, option[0],
                    reason, {"queue_s": best_p.worker.queue_s, "prefill_s": best_p.ttft_s - best_p.worker.queue_s,
                             "stall_s": best_p.stall_s, "decode_s": decode, "transfer_s": transfer, "admit_s": admit,
                             "decode_step_s": d.decode_step_s, "moved_tokens": moved})

    best = make(chosen)
    decoders = min((o for o in aggregated if not o[2]), default=best_agg)  # the reason compares with the decoders
    best = make(chosen, _reason(best, make(decoders) if decoders is not None else None, request))
    if not explain:
        return best
    # what the decision log shows it passed over: the best plan of the other kind first, then the runners-up
    other = best_split if chosen is best_agg else best_agg
    runners = heapq.nsmallest(4, (o for o in (*aggregated, *splits) if o is not chosen and o is not other),
                              key=lambda o: (o[0], o[1]))
    shown = ([other] if other is not None else []) + runners
    alternatives = tuple((make(o).describe(), o[0]) for o in shown[:4])
    return Plan(best.kind, best.worker, best.prefill, best.decode, best.encode, best.ttft_s, best.cost_s, best.reason,
                best.terms, alternatives)


def _reason(best: Plan, aggregated: Plan | None, request: RequestView) -> str:
    """Why, in the words the decision log shows."""
    if best.kind == "disaggregated":
        if aggregated is not None and aggregated.cost_s < best.cost_s:
            return "split: every request is split (disagg.split: always)"
        if aggregated is not None and aggregated.terms["stall_s"] > best.terms["stall_s"]:
            return "split: prefilling on a decoder would stall its running requests"
        return "split: the prefill pool gives the first token sooner"
    if best.terms["cached_tokens"] * 2 >= request.prompt_tokens:
        return "aggregated: it holds most of the prompt"
    if best.terms["on_prefill_worker"]:
        return "aggregated: whole on a prefill worker, sooner than a split"
    if not best.terms["decoding"]:
        return "aggregated: nothing decoding there to stall"
    if best.terms["stall_s"] == 0.0:
        return "aggregated: the uncached part is short (it rides in a decode step)"
    return "aggregated: local prefill is sooner than a split"


def view_of(worker_id: str, role: str, load: LoadSnapshot, model: WorkerModel, queue_s: float, cached_tokens: int,
            expected_output_tokens: int, encoder_cache: frozenset[str] = frozenset(), pressure: float = 0.0
            ) -> WorkerView:
    """A candidate's view from what routing already has: its load snapshot, its learnt parameters, kv_cost's
    queue for this request (kv_cost.predict(...).queue_s) and its prefill pressure (split.PrefillPressure)."""
    bias, s_tok, s_vis = model.params()
    turnover = model.request_turnover_s(expected_output_tokens)
    committed = load.used + load.pending_kv
    return WorkerView(worker_id, role, queue_s=queue_s, cached_tokens=cached_tokens, bias_s=bias, s_per_token=s_tok,
                      s_per_media_token=s_vis, decode_step_s=model.decode_step_s,
                      decoding=_decoding(role, load), kv_free_tokens=max(load.capacity - committed, 0.0),
                      kv_release_tokens_per_s=committed / turnover if turnover > 0 else math.inf,
                      encoder_cache=encoder_cache, pressure=pressure, turnover_s=turnover if turnover > 0 else math.inf)


def _decoding(role: str, load: LoadSnapshot) -> int:
    """Requests generating on the worker. A prefill worker's prefill legs end with their one token, and a reading of
    its running requests lags the legs that ended since: there only the whole requests this proxy sees producing
    output count."""
    return load.outputting if role in PREFILL_ROLES else load.running
