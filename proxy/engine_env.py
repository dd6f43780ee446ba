"""What a model's `env` in config.yaml may set: the names engines read, never what changes which code runs.

Owns the allowlist (prefixes and names) and the check; config.py applies it to every config source (the
file, `kvroute apply`, POST /fleet/apply). Not the environment a worker inherits (kvroute's own).
"""

from __future__ import annotations

import re

# What engines read; never what changes which code an interpreter or library runs (PYTHONPATH, LD_PRELOAD,
# PATH, BROWSER, ...). Workers inherit kvroute's own environment besides.
ENGINE_ENV_PREFIXES = ("CUDA_", "NCCL_", "NVIDIA_", "VLLM_", "LMDEPLOY_", "TM_", "HF_", "NIXL_", "UCX_", "GLOO_",
                       "OMP_", "MKL_", "OPENBLAS_", "KMP_", "PYTORCH_CUDA_", "TORCH_NCCL_", "TORCH_CUDA_",
                       "RAY_", "KVROUTE_SIM_")
ENGINE_ENV_NAMES = frozenset({"TOKENIZERS_PARALLELISM", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN",
                              "TP_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "TZ"})
# Inside those prefixes, names that load code or configuration from a path.
ENGINE_ENV_REFUSED = frozenset({"VLLM_LOGGING_CONFIG_PATH", "VLLM_PLUGINS", "VLLM_USE_PRECOMPILED",
                                "VLLM_CONFIG_ROOT", "HF_MODULES_CACHE"})
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")


def engine_env_allowed(name: str) -> bool:
    return (bool(_ENV_NAME.fullmatch(name)) and name not in ENGINE_ENV_REFUSED
            and (name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES)))
