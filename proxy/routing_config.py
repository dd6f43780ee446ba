"""config.yaml's routing knobs: each policy's weights, the estimator's priors, admission's rules, the prefix index.

Owns the typed schema of `proxy.routing` (fleet-wide) and `models[].routing` (a model's own policy knobs) and
how a model's keys lay over the fleet's; it decides nothing (proxy/routing/* and loadview.py read these objects,
as SGLang's policies read their typed PolicyConfig) and imports nothing of the proxy. The runs behind each
default: docs/design/.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Knobs(BaseModel):
    """A frozen set of knobs: shared by reference (every worker's load view holds admission's), replaced whole."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class KvAwareConfig(Knobs):
    """kv_aware's cost(w): docs/design/kv_aware.md names each term and the runs that set its weight."""

    queue_weight: float = Field(0.02, ge=0, description="per request waiting at the engine (50 weigh a full cache)")
    inflight_weight: float = Field(0.03, ge=0, description="per request in flight there (its decode batch)")
    prefix_weight: float = Field(1.0, ge=0, description="a cached prefix of prefix_saturation_tokens or more, in "
                                                        "units of a whole cache's KV usage")
    prefix_saturation_tokens: int = Field(1024, ge=1, description="cached tokens at which the prefix bonus is full")
    prefix_bonus_per_step: float = Field(3.0, ge=0, description="each step's worth of tokens of a cached prefix "
                                                                "beyond the engine's first step adds this to its "
                                                                "bonus (0: capped at 1)")
    prefix_by_share: bool = Field(True, description="weigh the prefix bonus by the share of the prompt cached")
    backlog_weight: float = Field(10.0, ge=0, description="per prompt token waiting to prefill there, / KV capacity")
    cached_prefill_credit: float = Field(0.5, ge=0, description="share of a cached prefix credited against the "
                                                               "prefill backlog")
    credit_per_usage: float = Field(0.0, ge=0, description="extra credit per unit of the holder's projected KV usage")
    credit_per_cache_share: float = Field(5.0, ge=0, description="extra credit per unit of the prefix's share of "
                                                                 "the holder's KV capacity")
    evict_weight: float = Field(1.0, ge=0, description="the prefixes routed to a worker more than once that a "
                                                    "request would push out of its cache, credited as a cached "
                                                    "prefix is (0: not counted)")
    shortlist: int = Field(8, ge=1, description="least loaded workers scored besides the prefix holders (the pick "
                                                "is the full scan's)")


class KvCostConfig(Knobs):
    """kv_cost's decision in time units: docs/design/decision-model.md."""

    resolution_s: float = Field(0.005, gt=0, description="predicted costs this close are a tie")
    shortlist_above: int = Field(16, ge=1, description="above this many candidates, score a random shortlist")
    shortlist: int = Field(8, ge=1, description="random candidates scored (plus the prefix holders)")
    learn_max_queue_share: float = Field(0.25, ge=0, description=(
        "learn prefill cost only from requests whose predicted queueing was at most this share of the measured "
        "time to first token"))


class DisaggConfig(Knobs):
    """A disaggregated model's decision (proxy/routing/split.py over disagg.py): docs/design/disaggregation.md."""

    split: Literal["conditional", "always"] = Field("conditional", description=(
        "conditional: split a request across the prefill and decode pools only when that is predicted sooner "
        "(or spares the decoders' running requests); always: every request that a prefill worker can take"))
    shortlist_above: int = Field(16, ge=1, description="above this many candidates, score a random shortlist per "
                                                       "role (plus the prefix holders)")
    shortlist: int = Field(8, ge=1, description="random candidates of each role scored")
    whole_on_prefill: bool = Field(False, description=(
        "conditional only: let a prefill worker also run requests whole when that is predicted sooner (more "
        "capacity on mixed traffic; the decodes it hosts are stalled by the pool's prefills, so inter-token "
        "latency p99 rises on long prompts: docs/design/disaggregation.md)"))
    pressure_window_s: float = Field(10.0, gt=0, description=(
        "with whole_on_prefill: time constant of each worker's prefill pressure (the stall its recent prefills "
        "caused per second), about a request's decode time"))
    stall_cost: Literal["slowdown", "request_seconds"] = Field("slowdown", description=(
        "how a prefill's stall of the requests decoding on its worker weighs against the request's own wait: "
        "slowdown (each stalled stream's delay over its decode time, against the wait over the request's prefill "
        "time) or request_seconds (every stalled second as one second of the request's own: splits more, lower "
        "inter-token tails, seconds of prefill-pool queue under load)"))


class PrefixConfig(Knobs):
    """prefix (SGLang's cache_aware over kvroute's prefix index)."""

    imbalance_abs_requests: int = Field(32, ge=0, description="in-flight spread above which load wins over cache ...")
    imbalance_ratio: float = Field(1.5, ge=1.0, description="... when the busiest also has this many times the "
                                                            "least busy's")
    min_match_fraction: float = Field(0.3, ge=0, le=1, description="share of the prompt a holder must cache")


class EstimatorConfig(Knobs):
    """The per-worker parameters kv_cost learns (docs/design/decision-model.md, "Learning"); priors hold until
    a worker reports its rates or a few requests were measured."""

    prior_bias_s: float = Field(0.01, ge=0, description="fixed part of a prefill")
    prior_prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="prefill rate")
    prior_vision_extra: float = Field(0.3, ge=0, description="extra cost of an image token over a text token")
    prior_decode_step_s: float = Field(0.02, gt=0, description="one decode step")
    prior_output_tokens: int = Field(256, ge=1, description="output length of a request that states none")
    prior_bias_sd_s: float = Field(0.05, gt=0, description="prior standard deviation of the bias")
    prior_s_per_token_sd: float = Field(2e-4, gt=0, description="... of the seconds per prompt token")
    prior_s_per_media_token_sd: float = Field(2e-4, gt=0, description="... of the extra seconds per image token")
    noise_sd_s: float = Field(0.005, gt=0, description="noise of one time-to-first-token measurement")
    shrink_n: float = Field(10.0, ge=0, description="measurements after which a worker's own parameters weigh as "
                                                    "much as the fleet's")
    residual_clip: float = Field(3.0, gt=0, description="a residual is clipped to this many noise_sd_s (plus half "
                                                        "the prediction)")
    forgetting_factor: float = Field(0.98, gt=0, le=1, description="recursive least squares forgetting: ~1/(1-f) "
                                                                   "recent measurements dominate")
    ewma_weight: float = Field(0.2, gt=0, le=1, description="weight of a new value in measured averages")
    reported_rate_tokens: float = Field(1000.0, gt=0, description="pseudo-observation size of a reported "
                                                                  "prefill rate")


class AdmissionConfig(Knobs):
    """How the load view counts what was sent since a worker's last report, and when a worker that reported no
    queue may be queueing after all (so admission holds): docs/design/admission.md."""

    dispatch_visible_after_s: float = Field(0.1, ge=0, description="a report this long after a dispatch shows it")
    dispatch_forget_after_s: float = Field(5.0, gt=0, description="a dispatch stops counting as pending after this")
    admit_after_output: bool = Field(True, description=(
        "a worker that reported no queue admits again only once what was sent to it since is confirmed by its "
        "first output"))
    admit_after_head: bool = Field(False, description="... or confirmed by its response head")
    confirm_above_kv_usage: float = Field(0.9, ge=0, description=(
        "that rule applies while the worker's projected KV usage is at least this ..."))
    confirm_above_prefill_tokens: int = Field(4096, ge=0, description=(
        "... or its prompt tokens still to prefill are at least this (at an engine budget of 8192 tokens per "
        "step; scaled by the engine's own where its worker reports one)"))


class PrefixIndexConfig(Knobs):
    """The prefix index: which worker was recently sent which prompt prefix."""

    max_blocks: int = Field(65536, ge=1, description="prefix blocks kept (~32 tokens each; ~20 MB at 65536)")
    ttl_s: float = Field(600.0, gt=0, description="an entry older than this is not trusted")


# the sections a model may set for itself; the others are one per proxy (shared by every model's workers)
FLEET_WIDE_SECTIONS = ("estimator", "admission", "prefix_index")


class PolicyKnobs(Knobs):
    """The policies' knobs: `models[].routing` sets a model's own (over `proxy.routing`'s)."""

    kv_aware: KvAwareConfig = Field(default_factory=KvAwareConfig)
    kv_cost: KvCostConfig = Field(default_factory=KvCostConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    disagg: DisaggConfig = Field(default_factory=DisaggConfig)

    @model_validator(mode="before")
    @classmethod
    def _fleet_wide_elsewhere(cls, data: Any) -> Any:
        if cls is PolicyKnobs and isinstance(data, dict):
            shared = [k for k in FLEET_WIDE_SECTIONS if k in data]
            if shared:
                raise ValueError(f"{', '.join(shared)}: one per proxy (its workers serve every model): "
                                 "set it under proxy.routing")
        return data


class RoutingConfig(PolicyKnobs):
    """`proxy.routing`: every model's policy knobs unless it sets its own, and the fleet-wide ones."""

    estimator: EstimatorConfig = Field(default_factory=EstimatorConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    prefix_index: PrefixIndexConfig = Field(default_factory=PrefixIndexConfig)

    def for_model(self, own: PolicyKnobs | None) -> PolicyKnobs:
        """The policy knobs of a model: this config's, with each key the model's `routing` sets replaced."""
        base = PolicyKnobs(kv_aware=self.kv_aware, kv_cost=self.kv_cost, prefix=self.prefix, disagg=self.disagg)
        if own is None or not own.model_fields_set:
            return base
        return base.model_copy(update={
            section: _overlay(getattr(base, section), getattr(own, section)) for section in own.model_fields_set})


K = TypeVar("K", bound=Knobs)


def _overlay(base: K, own: K) -> K:
    return base.model_copy(update={key: getattr(own, key) for key in own.model_fields_set})
