"""Online per-worker parameters of the routing model: prefill cost per token, decode step, TTFT bias.

Owns learning only (recursive least squares over the proxy's own time-to-first-byte measurements,
plus what workers report); it makes no decision (kv_cost.py does) and does no I/O.

    prefill_s(w) = bias(w) + s_tok(w) x uncached_tokens + s_vis(w) x uncached_media_tokens

theta = (bias, s_tok, s_vis) is fitted per worker by recursive least squares with forgetting (FORGET),
starting from priors that act as ridge regularisation, and shrunk towards the fleet's pooled theta
(SHRINK_N) so a new replica is priced like its siblings; residuals are clipped (CLIP). Reported prefill
rates and decode step times feed it too; turnover_s is an average of what the proxy measures. The model in
full: docs/design/decision-model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# Priors: a mid-size model on one datacenter GPU. They only matter until a worker reports rates
# or a few requests were measured.
PRIOR_BIAS_S = 0.01
PRIOR_PREFILL_TOKENS_PER_S = 10_000.0
# The vision tower costs about 4 patches x 2 FLOPs x ViT params per merged image token, i.e. a
# fraction of the LLM's 2 x params per token (0.28 for Qwen3-VL-8B): priced on top of prefill.
PRIOR_VISION_EXTRA = 0.3
PRIOR_DECODE_STEP_S = 0.02
PRIOR_OUTPUT_TOKENS = 256
# Prior standard deviations of theta, and of one TTFT measurement's noise (jitter of a step, of
# the event loops): their ratio sets how many observations it takes to move away from a prior.
PRIOR_SD = (0.05, 2e-4, 2e-4)
NOISE_SD = 0.005
SHRINK_N = 10.0
CLIP = 3.0
# RLS forgetting: ~1/(1-FORGET) = 50 recent observations dominate, so a worker that slows down
# (a noisy neighbour, thermal throttling, a bigger batch) is re-learnt within a few seconds of load.
FORGET = 0.98
# Exponential averaging weight of a new report / measurement for directly measured quantities.
EWMA = 0.2
# Pseudo-observation size for a reported prefill rate (tokens): scales its weight against bias.
REPORTED_RATE_TOKENS = 1000.0
MIN_S_PER_TOKEN, MAX_S_PER_TOKEN = 1e-7, 1e-1


class WorkerModel:
    """Learnt parameters of one worker (see the module docstring)."""

    __slots__ = ("theta", "cov", "decode_step_s", "turnover_s", "observations", "reported_rate",
                 "mean_prefill_tokens", "mean_kv_tokens", "pooled", "version", "_params", "_params_key")

    def __init__(self, pooled: WorkerModel | None = None) -> None:
        self.pooled = pooled  # the fleet's parameters, used until this worker is informed
        s_tok = 1.0 / PRIOR_PREFILL_TOKENS_PER_S
        self.theta = [PRIOR_BIAS_S, s_tok, PRIOR_VISION_EXTRA * s_tok]
        # covariance in units of the measurement noise's variance (what RLS's gain formula assumes)
        self.cov = [[_prior_var(i) if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.decode_step_s = PRIOR_DECODE_STEP_S
        self.turnover_s: float | None = None
        self.observations = 0
        self.reported_rate = False
        # what a request sent to this worker typically costs it (prices the ones it reports waiting)
        self.mean_prefill_tokens = 0.0
        self.mean_kv_tokens = 0.0
        self.version = 0  # bumped whenever theta changes: params() is cached on it
        self._params: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._params_key: tuple[int, int] | None = None

    # --- what the decision reads -------------------------------------------------------------
    @property
    def informed(self) -> bool:
        return self.observations > 0 or self.reported_rate

    def _effective(self, i: int) -> float:
        pooled = self.pooled
        if pooled is None:
            return self.theta[i]
        n = self.observations + (SHRINK_N if self.reported_rate else 0.0)
        weight = n / (n + SHRINK_N)
        return pooled.theta[i] + weight * (self.theta[i] - pooled.theta[i])

    def params(self) -> tuple[float, float, float]:
        """(bias_s, s_per_token, s_per_media_token) as the decision uses them (shrunk, clamped; cached)."""
        key = (self.version, self.pooled.version if self.pooled is not None else 0)
        if key != self._params_key:
            self._params = (min(max(self._effective(0), 0.0), 10.0),
                            min(max(self._effective(1), MIN_S_PER_TOKEN), MAX_S_PER_TOKEN),
                            min(max(self._effective(2), 0.0), MAX_S_PER_TOKEN))
            self._params_key = key
        return self._params

    @property
    def bias_s(self) -> float:
        return self.params()[0]

    @property
    def s_per_token(self) -> float:
        return self.params()[1]

    @property
    def s_per_media_token(self) -> float:
        return self.params()[2]

    def prefill_s(self, uncached_tokens: float, uncached_media_tokens: float) -> float:
        """Seconds from the head of the queue to the first token for this much new prompt."""
        bias, s_tok, s_vis = self.params()
        return bias + s_tok * uncached_tokens + s_vis * uncached_media_tokens

    def request_turnover_s(self, expected_output_tokens: int) -> float:
        """How long a request stays running after its first token (it holds its KV until then)."""
        source = self if self.turnover_s is not None or self.pooled is None else self.pooled
        if source.turnover_s is not None:
            return source.turnover_s
        return source.decode_step_s * (expected_output_tokens or PRIOR_OUTPUT_TOKENS)

    # --- learning ------------------------------------------------------------------------------
    def observe_prefill(self, uncached_tokens: float, uncached_media_tokens: float, seconds: float) -> None:
        """One measured (time to first byte - predicted queueing) for this much new prompt."""
        self._rls((1.0, float(uncached_tokens), float(uncached_media_tokens)), seconds)
        self.observations += 1
        self._pool()

    def observe_report(self, prefill_tokens_per_s: float | None, decode_step_s: float | None) -> None:
        if prefill_tokens_per_s is not None and prefill_tokens_per_s > 0:
            # what REPORTED_RATE_TOKENS cost at the reported rate, without the fixed part
            self._rls((0.0, REPORTED_RATE_TOKENS, 0.0), REPORTED_RATE_TOKENS / prefill_tokens_per_s)
            self.reported_rate = True
        if decode_step_s is not None and decode_step_s > 0:
            self.decode_step_s += EWMA * (decode_step_s - self.decode_step_s)
            if self.pooled is not None:
                self.pooled.decode_step_s += EWMA * (self.decode_step_s - self.pooled.decode_step_s)
        if self.reported_rate:
            self._pool()

    def observe_dispatch(self, prefill_tokens: int, kv_tokens: int) -> None:
        if self.mean_kv_tokens == 0.0:
            self.mean_prefill_tokens, self.mean_kv_tokens = float(prefill_tokens), float(kv_tokens)
            return
        self.mean_prefill_tokens += EWMA * (prefill_tokens - self.mean_prefill_tokens)
        self.mean_kv_tokens += EWMA * (kv_tokens - self.mean_kv_tokens)

    def observe_turnover(self, seconds: float) -> None:
        if seconds < 0:
            return
        self.turnover_s = seconds if self.turnover_s is None else self.turnover_s + EWMA * (seconds - self.turnover_s)
        if self.pooled is not None:
            self.pooled.observe_turnover(self.turnover_s)

    def _pool(self) -> None:
        pooled = self.pooled
        if pooled is None:
            return
        pooled.version += 1
        if not pooled.informed:  # the first informed worker replaces the priors outright
            pooled.theta = list(self.theta)
            pooled.observations = 1
            return
        for i in range(3):
            pooled.theta[i] += EWMA * (self.theta[i] - pooled.theta[i])

    def _rls(self, x: tuple[float, float, float], y: float) -> None:
        p, theta = self.cov, self.theta
        px = [p[i][0] * x[0] + p[i][1] * x[1] + p[i][2] * x[2] for i in range(3)]
        denom = FORGET + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        gain = [v / denom for v in px]
        predicted = theta[0] * x[0] + theta[1] * x[1] + theta[2] * x[2]
        limit = CLIP * NOISE_SD + 0.5 * abs(predicted)
        error = min(max(y - predicted, -limit), limit)
        for i in range(3):
            theta[i] += gain[i] * error
        self.version += 1
        for i in range(3):
            for j in range(3):
                p[i][j] = (p[i][j] - gain[i] * px[j]) / FORGET
        # Without fresh excitation (e.g. no images) forgetting would inflate a direction without
        # bound ("wind-up"); the prior's variance is the most any direction may have.
        for i in range(3):
            limit = _prior_var(i)
            if p[i][i] > limit:
                scale = (limit / p[i][i]) ** 0.5
                for j in range(3):
                    p[i][j] *= scale
                    p[j][i] *= scale


def _prior_var(i: int) -> float:
    return (PRIOR_SD[i] / NOISE_SD) ** 2


@dataclass
class FleetEstimator:
    """One WorkerModel per worker id, made on first use with the priors."""

    models: dict[str, WorkerModel]

    def __init__(self) -> None:
        self.models = {}
        self.pooled = WorkerModel()

    def for_worker(self, worker_id: str) -> WorkerModel:
        model = self.models.get(worker_id)
        if model is None:
            model = self.models[worker_id] = WorkerModel(self.pooled)
        return model

    def forget(self, worker_id: str) -> None:
        self.models.pop(worker_id, None)
