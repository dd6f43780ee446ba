"""How one replica of a model is started: the `kvroute worker` command line and environment.

Owns the mapping from a ModelConfig (+ the GPUs, port and id the fleet chose) to argv/env, and a model's
pools as the fleet runs them (`pools_of`: each role's settings merged over the model's); it does not run
anything (placement/local.py and placement/ray.py do).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from proxy.config import ModelConfig
from proxy.pools import KvTransfer

# Fields that only the proxy reads (routing, naming, counts): changing them never restarts a worker.
# `pools` is expanded (pools_of): each pool's own settings are in its merged ModelConfig.
_PROXY_SIDE_FIELDS = {"replicas", "aliases", "policy", "pools"}


@dataclass(frozen=True)
class PoolSpec:
    """One pool of a model as the fleet runs it: its role, and the model with the pool's settings merged in
    (engine_args, env, gpus_per_replica, preset; `replicas` is the pool's)."""

    role: str
    model: ModelConfig
    pooled: bool = False  # the model lists `pools` (else it is one pool of role both, from `replicas`)

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def replicas(self) -> int:
        return self.model.replicas

    @property
    def label(self) -> str:
        """`qwen` for an aggregated model's one pool, `qwen/decode` for a pool of a disaggregated one."""
        return f"{self.name}/{self.role}" if self.pooled else self.name


def _merged_args(base: Any, extra: Any, model: ModelConfig) -> Any:
    if not extra:
        return base
    if isinstance(base, dict) and isinstance(extra, dict):
        return {**base, **extra}
    as_list = ModelConfig.engine_arg_list
    return [*as_list(model), *as_list(model.model_copy(update={"engine_args": extra}))]


def pools_of(model: ModelConfig) -> list[PoolSpec]:
    """Every pool of `model`; a model with prefill or decode pools gets the default KV connector if it names none."""
    pools = model.pool_list()
    disaggregated = any(p.role in ("prefill", "decode") for p in pools)
    kv = model.kv_transfer or (KvTransfer() if disaggregated else None)
    out = []
    for pool in pools:
        merged = model.model_copy(update={
            "replicas": pool.replicas, "pools": [], "kv_transfer": kv,
            "engine_args": _merged_args(model.engine_args, pool.engine_args, model),
            "env": {**model.env, **pool.env},
            "gpus_per_replica": model.gpus_per_replica if pool.gpus_per_replica is None else pool.gpus_per_replica,
            "preset": pool.preset or model.preset})
        out.append(PoolSpec(pool.role, merged, pooled=bool(model.pools)))
    return out


def spec_fingerprint(model: ModelConfig, role: str = "both") -> str:
    """A short hash of everything that decides how a worker process runs; a change means a rolling restart."""
    data = model.model_dump(mode="json", exclude=_PROXY_SIDE_FIELDS)
    if role != "both":
        data["role"] = role
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def worker_id_for(model: str, index: int, generation: int, role: str = "both") -> str:
    """`qwen-0`; after a spec change the replacement is `qwen-0-g1`, so old and new can coexist while rolling.
    A pool of another role than both names it: `qwen-decode-0`.

    The id goes into URL paths (/workers/{id}) and file names: "Qwen/Qwen3-VL-8B" becomes "Qwen-Qwen3-VL-8B".
    """
    base = _UNSAFE_ID_CHARS.sub("-", model).strip("-") or "model"
    if role != "both":
        base = f"{base}-{role}"
    return f"{base}-{index}" if generation == 0 else f"{base}-{index}-g{generation}"


@dataclass
class WorkerLaunch:
    """Everything a placement needs to start one worker; `port` 0 means "pick one on the node"."""

    worker_id: str
    model: ModelConfig
    proxy_url: str
    gpus: list[str] | None = None  # None: the placement (Ray) decides the visible GPUs
    drain_grace_s: float = 30.0
    worker_token: str | None = None
    log_level: str = "info"
    extra_env: dict[str, str] = field(default_factory=dict)
    role: str = "both"

    def _role_flags(self) -> list[str]:
        """--role, and the KV / encoder-output connectors resolved for this role (the worker turns them into
        the engine's own flags: backends/engines/vllm.py, backends/sim/transfer.py)."""
        m = self.model
        flags = ["--role", self.role] if self.role != "both" else []
        if m.kv_transfer is not None:
            # the sim plays NIXL's protocol (the params round trip) whatever the connector named
            connector = "NixlConnector" if m.engine == "sim" else m.kv_transfer.connector_for(m.device)
            kv = {"connector": connector, "kv_role": m.kv_transfer.kv_role(self.role),
                  "extra": m.kv_transfer.extra, "options": m.kv_transfer.options, "link": m.kv_transfer.link}
            flags += ["--kv-transfer", json.dumps(kv, sort_keys=True)]
        if m.ec_transfer is not None:
            ec = {"connector": m.ec_transfer.connector, "extra": m.ec_transfer.extra,
                  "options": m.ec_transfer.options}
            flags += ["--ec-transfer", json.dumps(ec, sort_keys=True)]
        return flags

    def argv(self, host: str, port: int, advertise_url: str | None = None,
             python: str = sys.executable) -> list[str]:
        m = self.model
        cmd = [python, "-m", "proxy.cli", "worker", "--engine", m.engine, "--host", host, "--port", str(port),
               "--served-model-name", m.name, "--proxy-url", self.proxy_url, "--worker-id", self.worker_id,
               "--drain-grace-s", f"{self.drain_grace_s:g}", "--log-level", self.log_level]
        if advertise_url:
            cmd += ["--advertise-url", advertise_url]
        if self.gpus:
            cmd += ["--gpus", ",".join(self.gpus)]
        cmd += self._role_flags()
        if m.engine == "sim":
            # The simulator's options are the worker's own flags (--time-scale, --max-num-seqs, ...).
            if m.preset:
                cmd += ["--preset", m.preset]
            return cmd + m.engine_arg_list()
        cmd += ["--device", m.device, "--startup-timeout-s", f"{m.startup_timeout_s:g}"]
        if m.model:
            cmd += ["--model", m.model]
        args = m.engine_arg_list()
        return cmd + (["--", *args] if args else [])

    def env(self) -> dict[str, str]:
        """Variables to add to the parent's environment for this worker."""
        env = {"PYTHONUNBUFFERED": "1", "KVROUTE_WORKER_ID": self.worker_id, **self.model.env, **self.extra_env}
        if self.gpus is not None:
            # An empty list still sets the variable: a CPU replica must not grab every GPU on the box.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        if self.worker_token:
            env["KVROUTE_WORKER_TOKEN"] = self.worker_token  # env, not argv: argv is visible in `ps`
        return env
