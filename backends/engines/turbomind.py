"""The LMDeploy adapter (`--engine turbomind`): api_server command line, which engine really runs, and load.

Owns LMDeploy specifics only; the supervisor (backends/worker.py) runs the process. Needs an
NVIDIA GPU; nothing here imports lmdeploy.

- Command: `lmdeploy serve api_server MODEL --backend turbomind ... --tp N`, N = number of --gpus; never
  LMDeploy's own `--proxy-url` (the supervisor registers and reports itself).
- Which engine runs: LMDeploy 0.18 falls back to its PyTorch engine for Qwen3-VL and logs `Fallback to
  pytorch engine because ...`; `observe_log_line` switches the reported engine to "pytorch" on that line.
- Load: LMDeploy's scheduler gauges refresh only every 10 s, so the running count comes from its request
  histograms (ttft count - e2e count) and KV usage is projected from it. The derivation:
  docs/design/engines.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from backends.engines.base import EngineLaunch, MetricsReader
from backends.reporter import Load
from proxy import promtext

KV_USAGE = "lmdeploy:gpu_cache_usage_perc"
RUNNING = "lmdeploy:num_requests_running"
WAITING = "lmdeploy:num_requests_waiting"
PREFIX_HIT_RATE = "lmdeploy:prefix_cache_hit_rate"
FIRST_TOKENS = "lmdeploy:time_to_first_token_seconds_count"
FINISHED = "lmdeploy:e2e_request_latency_seconds_count"
METRIC_NAMES = (KV_USAGE, RUNNING, WAITING, PREFIX_HIT_RATE, FIRST_TOKENS, FINISHED)
FALLBACK_MARKER = "Fallback to pytorch engine"


def projected_load(metrics: promtext.Metrics) -> Load:
    """The 4 Hz load estimate described in the module docstring."""
    gauge_usage = promtext.kv_usage(metrics, [KV_USAGE]) or 0.0
    gauge_running = int(metrics.total(RUNNING) or 0)
    waiting = int(metrics.total(WAITING) or 0)
    hit_rate = metrics.mean(PREFIX_HIT_RATE) or 0.0
    first_tokens, finished = metrics.total(FIRST_TOKENS), metrics.total(FINISHED)
    if first_tokens is None or finished is None:
        return Load(gauge_usage, gauge_running, waiting, hit_rate)
    running = max(int(first_tokens - finished), 0)
    usage = gauge_usage * running / gauge_running if gauge_running > 0 else gauge_usage
    return Load(min(max(usage, 0.0), 1.0), running, waiting, hit_rate)


class TurbomindAdapter:
    family = "turbomind"
    ready_path = "/v1/models"

    def __init__(self) -> None:
        self._engine = "turbomind"
        self._metrics = MetricsReader(METRIC_NAMES, probe=RUNNING)
        self._step_tokens: int | None = None  # --max-prefill-token-num, when given

    @property
    def running_engine(self) -> str:
        return self._engine

    def command(self, launch: EngineLaunch) -> list[str]:
        cmd = ["lmdeploy", "serve", "api_server", launch.model]
        backend = launch.arg_value("--backend")
        self._step_tokens = launch.int_arg("--max-prefill-token-num")
        if backend is None:
            cmd += ["--backend", "turbomind"]
        elif backend == "pytorch":
            self._engine = "pytorch"
        cmd += ["--server-name", launch.host, "--server-port", str(launch.port),
                "--model-name", launch.served_model_name]
        if launch.gpus and not launch.has_arg("--tp"):
            cmd += ["--tp", str(len(launch.gpus))]
        return cmd + list(launch.engine_args)

    def environment(self, launch: EngineLaunch, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        if launch.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(launch.gpus)
        return env

    def kv_event_scheme(self, launch: EngineLaunch, env: Mapping[str, str]) -> tuple[str, str] | None:
        return None  # LMDeploy publishes no KV events: the proxy's approximate index serves its workers

    def observe_log_line(self, line: str) -> None:
        if FALLBACK_MARKER in line:
            self._engine = "pytorch"

    async def in_flight(self, session: aiohttp.ClientSession, base_url: str) -> int | None:
        return None  # LMDeploy's api_server has no such count: drain falls back to running + waiting

    async def read_load(self, session: aiohttp.ClientSession, base_url: str) -> Load:
        load = projected_load(promtext.parse(await self._metrics.read(session, base_url), names=METRIC_NAMES))
        load.max_num_batched_tokens = self._step_tokens
        return load
