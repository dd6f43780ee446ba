"""How one replica of a model is started: the `kvroute worker` command line and environment.

Owns the mapping from a ModelConfig (+ the GPUs, port and id the fleet chose) to argv/env;
it does not run anything (placement/local.py and placement/ray.py do).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field

from proxy.config import ModelConfig

# Fields that only the proxy reads (routing, naming, counts): changing them never restarts a worker.
_PROXY_SIDE_FIELDS = {"replicas", "aliases", "policy"}


def spec_fingerprint(model: ModelConfig) -> str:
    """A short hash of everything that decides how a worker process runs; a change means a rolling restart."""
    data = model.model_dump(mode="json", exclude=_PROXY_SIDE_FIELDS)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def worker_id_for(model: str, index: int, generation: int) -> str:
    """`qwen-0`; after a spec change the replacement is `qwen-0-g1`, so old and new can coexist while rolling.

    The id goes into URL paths (/workers/{id}) and file names: "Qwen/Qwen3-VL-8B" becomes "Qwen-Qwen3-VL-8B".
    """
    base = _UNSAFE_ID_CHARS.sub("-", model).strip("-") or "model"
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
