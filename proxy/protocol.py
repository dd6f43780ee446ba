"""The wire schema between workers and the proxy: registration and load reports.

Owns only data shapes (pydantic), their JSON names and the bounds of every field; workers import it
too, so it imports nothing else from the proxy but the leaf proxy/identifiers.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from proxy import identifiers as ids
from proxy.kvevents import KvEventBatch

# Engines a worker may say it runs. "pytorch" is LMDeploy's PyTorch engine, which
# LMDeploy falls back to when TurboMind lacks the model (Qwen3-VL as of 0.18).
EngineName = Literal["vllm", "turbomind", "pytorch", "sim", "unknown"]
WorkerReportedState = Literal["starting", "ready", "draining", "failed"]
# What a worker does in a disaggregated fleet: "both" serves whole requests (today's, the default);
# "prefill" and "decode" split a request's prompt from its generation (the KV moves between them), and
# "encode" runs only the vision encoder (proxy/pools.py, docs/design/disaggregation.md).
WorkerRole = Literal["both", "prefill", "decode", "encode"]

# How often the proxy asks each worker for a load report (its answers to registration and to every report
# say it): every REPORT_INTERVAL_S while the fleet is small, slower as it grows so that all workers together
# send at most REPORTS_PER_S (each costs the proxy CPU: docs/design/data-plane.md), and never slower than
# REPORT_INTERVAL_MAX_S (4 Hz). Admission confirms a request the engine took in by a report or by its first
# output (proxy/workers/loadview.py): a fresh report matters there (docs/design/admission.md).
REPORT_INTERVAL_S = 0.05
REPORT_INTERVAL_MAX_S = 0.25
REPORTS_PER_S = 200.0
# The proxy marks a worker stale when no report arrived for this long.
STALE_AFTER_S = 2.0

WORKER_TOKEN_HEADER = "Authorization"  # "Bearer <token>": the worker token to register, then the worker's secret
WORKER_SECRET_HEADER = "x-kvroute-worker-secret"  # a re-registering worker's previous secret (proves its id)


# Bounds of what a worker may say (docs/security.md, "Numbers from workers and Redis"): every integer fits
# int64, so no view can fail to encode it; each bound is far above any real engine and far below what
# would overflow the proxy's arithmetic. Lies inside them are the trust factor's (proxy/workers/report_trust.py).
INT64_MAX = 2**63 - 1
MAX_REQUESTS = 1_000_000                # num_running, num_waiting
MAX_KV_CAPACITY_TOKENS = 2**40          # ~1.1e12: a thousand times the KV cache of a whole 8-GPU node
MAX_STEP_TOKENS = 2**24                 # max_num_batched_tokens, max_model_len (16.7M tokens)
MAX_PREFILL_TOKENS_PER_S = 1e9
MAX_DECODE_STEP_S = 3600.0
MAX_UNIX_TIME = 2**40                   # sent_at, in seconds (year 36812)
MAX_GPUS = 64
MAX_WORK_COUNTER = 1e18                 # an engine's cumulative prompt / generated tokens, preemptions

WorkerId = Annotated[str, AfterValidator(ids.worker_id)]
ModelName = Annotated[str, AfterValidator(ids.model_name)]
WorkerUrl = Annotated[str, AfterValidator(ids.worker_url)]
Labels = Annotated[dict[str, str], AfterValidator(ids.labels)]
BootId = Annotated[str, AfterValidator(lambda v: ids.visible_token(v, "boot_id", 64))]
ApiKeyText = Annotated[str, AfterValidator(lambda v: ids.visible_token(v, "api_key"))]
GpuId = Annotated[str, AfterValidator(lambda v: ids.visible_token(v, "a gpu id", 64))]
ModelList = Annotated[list[ModelName], Field(min_length=1, max_length=ids.MAX_MODELS_PER_WORKER)]


def report_interval_for(num_workers: int) -> float:
    """The report interval the proxy asks of each of `num_workers` workers (see REPORT_INTERVAL_S)."""
    return min(REPORT_INTERVAL_MAX_S, max(REPORT_INTERVAL_S, num_workers / REPORTS_PER_S))


class WorkerRegistration(BaseModel):
    """Body of `POST /workers`: a worker announcing itself."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    worker_id: WorkerId | None = Field(None, description="stable id; the proxy makes one from the url if absent")
    url: WorkerUrl = Field(..., description="base URL the proxy forwards to, e.g. http://10.0.0.5:8101")
    models: ModelList
    engine: EngineName = "unknown"
    kv_capacity_tokens: int | None = Field(None, ge=1, le=MAX_KV_CAPACITY_TOKENS)
    max_model_len: int | None = Field(None, ge=1, le=MAX_STEP_TOKENS)
    gpus: list[GpuId] = Field(default_factory=list, max_length=MAX_GPUS,
                              description="device ids the worker holds, as strings")
    reports: bool = Field(True, description="False: the proxy scrapes /metrics instead of waiting for reports")
    labels: Labels = Field(default_factory=dict)
    role: WorkerRole = Field("both", description="its part in a disaggregated fleet (see WorkerRole)")
    boot_id: BootId | None = Field(None, description="new at every start of the worker process: a new one restarts "
                                                     "`seq`")
    api_key: ApiKeyText | None = Field(None, repr=False,
                                description="key the proxy sends the worker as Authorization: Bearer (its engine's "
                                            "--api-key); never shown in /workers")


class RegistrationAccepted(BaseModel):
    """Answer to `POST /workers`."""

    worker_id: str
    report_interval_s: float = REPORT_INTERVAL_MAX_S  # report_interval_for(fleet size) in the proxy's answers
    # Reports, drain and deregistration of this worker need it (Authorization: Bearer <secret>); a new
    # one is issued at every registration, so a report's seq counts within one registration only.
    worker_secret: str | None = None


class ReportAccepted(BaseModel):
    """Answer to `POST /workers/{id}/report`: the interval to keep reporting at (it follows the fleet's size)."""

    ok: bool = True
    report_interval_s: float = REPORT_INTERVAL_MAX_S
    kv_resync: bool = False  # the proxy's view of this worker's engine blocks is stale: send a snapshot next


class LoadReport(BaseModel):
    """Body of `POST /workers/{id}/report`, sent at the interval the proxy asks for (DESIGN.md's schema)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    worker_id: WorkerId
    url: WorkerUrl
    models: ModelList
    engine: EngineName = "unknown"
    state: WorkerReportedState = "ready"
    role: WorkerRole = "both"
    kv_cache_usage: float = Field(..., ge=0.0, le=1.0)
    kv_capacity_tokens: int = Field(..., ge=0, le=MAX_KV_CAPACITY_TOKENS)
    num_running: int = Field(..., ge=0, le=MAX_REQUESTS)
    num_waiting: int = Field(..., ge=0, le=MAX_REQUESTS)
    prefix_cache_hit_rate: float = Field(0.0, ge=0.0, le=1.0)
    # Optional rates for the routing model (proxy/routing/estimator.py), in wall-clock seconds:
    # recent prompt tokens prefilled per second of prefill work, and the recent decode step time.
    prefill_tokens_per_s: float | None = Field(None, gt=0, le=MAX_PREFILL_TOKENS_PER_S)
    decode_step_s: float | None = Field(None, gt=0, le=MAX_DECODE_STEP_S)
    # The engine's token budget per scheduler step (vLLM --max-num-batched-tokens, LMDeploy
    # --max-prefill-token-num) when the worker knows it; admission scales its prefill threshold by it.
    max_num_batched_tokens: int | None = Field(None, ge=1, le=MAX_STEP_TOKENS)
    # The engine's cumulative work counters (vLLM's vllm:prompt_tokens_total, vllm:generation_tokens_total and
    # vllm:num_preemptions_total; None: the engine has none): counters that move show an engine at work however
    # quiet its streams are (proxy/dataplane/stall.py).
    prompt_tokens_total: float | None = Field(None, ge=0, le=MAX_WORK_COUNTER)
    generation_tokens_total: float | None = Field(None, ge=0, le=MAX_WORK_COUNTER)
    preemptions_total: float | None = Field(None, ge=0, le=MAX_WORK_COUNTER)
    seq: int = Field(..., ge=0, le=INT64_MAX, description="monotonic per worker; older reports are ignored")
    boot_id: BootId | None = Field(None, description="the registration's boot_id; seq counts within it")
    # the engine's prefix-cache changes since the last report (workers whose engine publishes KV events)
    kv_events: KvEventBatch | None = None
    sent_at: float = Field(default_factory=time.time, ge=0, le=MAX_UNIX_TIME, description="unix seconds at the worker")
