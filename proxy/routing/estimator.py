"""Online per-worker parameters of the routing model: prefill cost per token, decode step, TTFT bias.

Owns learning only (recursive least squares over the proxy's own time-to-first-byte measurements,
plus what workers report); it makes no decision (kv_cost.py does) and does no I/O.

    prefill_s(w) = bias(w) + s_tok(w) x uncached_tokens + s_vis(w) x uncached_media_tokens

theta = (bias, s_tok, s_vis) is fitted per worker by recursive least squares with forgetting, starting from
priors that act as ridge regularisation, and shrunk towards the fleet's pooled theta so a new replica is
priced like its siblings; residuals are clipped. Reported prefill rates and decode step times feed it too;
turnover_s is an average of what the proxy measures. The priors and rates are config.yaml's
`proxy.routing.estimator` (routing_config.EstimatorConfig). The model in full: docs/design/decision-model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.routing_config import EstimatorConfig

# Bounds of a learnt cost per token, whatever the measurements say (not knobs: sanity limits).
MIN_S_PER_TOKEN, MAX_S_PER_TOKEN = 1e-7, 1e-1


class WorkerModel:
    """Learnt parameters of one worker (see the module docstring)."""

    __slots__ = ("theta", "cov", "decode_step_s", "turnover_s", "observations", "reported_rate",
                 "mean_prefill_tokens", "mean_kv_tokens", "pooled", "version", "_params", "_params_key", "knobs")

    def __init__(self, pooled: WorkerModel | None = None, knobs: EstimatorConfig | None = None) -> None:
        self.pooled = pooled  # the fleet's parameters, used until this worker is informed
        self.knobs = knobs or EstimatorConfig()
        self.theta: list[float] = []
        self.cov: list[list[float]] = []
        self.reset_priors()
        self.decode_step_s = self.knobs.prior_decode_step_s
        self.turnover_s: float | None = None
        self.observations = 0
        self.reported_rate = False
        # what a request sent to this worker typically costs it (prices the ones it reports waiting)
        self.mean_prefill_tokens = 0.0
        self.mean_kv_tokens = 0.0
        self.version = 0  # bumped whenever theta changes: params() is cached on it
        self._params: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._params_key: tuple[int, int] | None = None

    def reset_priors(self) -> None:
        """theta and its covariance as the priors say (a worker nothing has informed yet)."""
        knobs = self.knobs
        s_tok = 1.0 / knobs.prior_prefill_tokens_per_s
        self.theta = [knobs.prior_bias_s, s_tok, knobs.prior_vision_extra * s_tok]
        # covariance in units of the measurement noise's variance (what RLS's gain formula assumes)
        self.cov = [[self._prior_var(i) if i == j else 0.0 for j in range(3)] for i in range(3)]

    def _prior_var(self, i: int) -> float:
        knobs = self.knobs
        sd = (knobs.prior_bias_sd_s, knobs.prior_s_per_token_sd, knobs.prior_s_per_media_token_sd)[i]
        return (sd / knobs.noise_sd_s) ** 2

    # --- what the decision reads -------------------------------------------------------------
    @property
    def informed(self) -> bool:
        return self.observations > 0 or self.reported_rate

    def _effective(self, i: int) -> float:
        pooled = self.pooled
        if pooled is None:
            return self.theta[i]
        shrink_n = self.knobs.shrink_n
        n = self.observations + (shrink_n if self.reported_rate else 0.0)
        weight = n / (n + shrink_n) if n else 0.0
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
        return source.decode_step_s * (expected_output_tokens or self.knobs.prior_output_tokens)

    # --- learning ------------------------------------------------------------------------------
    def observe_prefill(self, uncached_tokens: float, uncached_media_tokens: float, seconds: float) -> None:
        """One measured (time to first byte - predicted queueing) for this much new prompt."""
        self._rls((1.0, float(uncached_tokens), float(uncached_media_tokens)), seconds)
        self.observations += 1
        self._pool()

    def observe_report(self, prefill_tokens_per_s: float | None, decode_step_s: float | None) -> None:
        ewma = self.knobs.ewma_weight
        if prefill_tokens_per_s is not None and prefill_tokens_per_s > 0:
            # what reported_rate_tokens cost at the reported rate, without the fixed part
            tokens = self.knobs.reported_rate_tokens
            self._rls((0.0, tokens, 0.0), tokens / prefill_tokens_per_s)
            self.reported_rate = True
        if decode_step_s is not None and decode_step_s > 0:
            self.decode_step_s += ewma * (decode_step_s - self.decode_step_s)
            if self.pooled is not None:
                self.pooled.decode_step_s += ewma * (self.decode_step_s - self.pooled.decode_step_s)
        if self.reported_rate:
            self._pool()

    def observe_dispatch(self, prefill_tokens: int, kv_tokens: int) -> None:
        if self.mean_kv_tokens == 0.0:
            self.mean_prefill_tokens, self.mean_kv_tokens = float(prefill_tokens), float(kv_tokens)
            return
        ewma = self.knobs.ewma_weight
        self.mean_prefill_tokens += ewma * (prefill_tokens - self.mean_prefill_tokens)
        self.mean_kv_tokens += ewma * (kv_tokens - self.mean_kv_tokens)

    def observe_turnover(self, seconds: float) -> None:
        if seconds < 0:
            return
        self.turnover_s = (seconds if self.turnover_s is None
                           else self.turnover_s + self.knobs.ewma_weight * (seconds - self.turnover_s))
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
        ewma = self.knobs.ewma_weight
        for i in range(3):
            pooled.theta[i] += ewma * (self.theta[i] - pooled.theta[i])

    def _rls(self, x: tuple[float, float, float], y: float) -> None:
        knobs = self.knobs
        forget = knobs.forgetting_factor
        p, theta = self.cov, self.theta
        px = [p[i][0] * x[0] + p[i][1] * x[1] + p[i][2] * x[2] for i in range(3)]
        denom = forget + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        gain = [v / denom for v in px]
        predicted = theta[0] * x[0] + theta[1] * x[1] + theta[2] * x[2]
        limit = knobs.residual_clip * knobs.noise_sd_s + 0.5 * abs(predicted)
        error = min(max(y - predicted, -limit), limit)
        for i in range(3):
            theta[i] += gain[i] * error
        self.version += 1
        for i in range(3):
            for j in range(3):
                p[i][j] = (p[i][j] - gain[i] * px[j]) / forget
        # Without fresh excitation (e.g. no images) forgetting would inflate a direction without
        # bound ("wind-up"); the prior's variance is the most any direction may have.
        for i in range(3):
            limit = self._prior_var(i)
            if p[i][i] > limit:
                scale = (limit / p[i][i]) ** 0.5
                for j in range(3):
                    p[i][j] *= scale
                    p[j][i] *= scale


@dataclass
class FleetEstimator:
    """One WorkerModel per worker id, made on first use with the priors."""

    models: dict[str, WorkerModel]

    def __init__(self, knobs: EstimatorConfig | None = None) -> None:
        self.models = {}
        self.knobs = knobs or EstimatorConfig()
        self.pooled = WorkerModel(knobs=self.knobs)

    def configure(self, knobs: EstimatorConfig) -> None:
        """New priors and rates (a config edit): what was learnt is kept; the priors replace only what nothing
        informed yet (the pooled theta, and workers without a measurement or a reported rate)."""
        if knobs == self.knobs:
            return
        self.knobs = knobs
        for model in (self.pooled, *self.models.values()):
            model.knobs = knobs
            if not model.informed:
                model.reset_priors()
            model.version += 1  # params() depend on shrink_n

    def for_worker(self, worker_id: str) -> WorkerModel:
        model = self.models.get(worker_id)
        if model is None:
            model = self.models[worker_id] = WorkerModel(self.pooled, self.knobs)
        return model

    def forget(self, worker_id: str) -> None:
        self.models.pop(worker_id, None)
