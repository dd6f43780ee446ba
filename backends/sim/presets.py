"""Hardware/model presets for the sim engine: KV size, batch limits and step-time constants.

Owns the numbers and where they come from; the step-time formula that uses them lives in cost.py.

The GPU presets are a roofline (bf16 weights and KV, one GPU): KV capacity from HBM x gpu_memory_utilization
less weights and an activation reserve; a step takes a fixed and a per-sequence overhead plus the larger of
its memory time (weights + KV read, at a share of HBM bandwidth) and its compute time (at an MFU). Constants
come from NVIDIA's H100/H200 datasheets and the Qwen3 configs. `cpu-tiny` is fitted to the tiny Qwen3-VL on
vLLM CPU (`python -m bench.sim_vs_vllm_cpu`). The derivation, the sources and the fit: docs/design/sim.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class Preset:
    """Everything the engine needs to know about one (GPU, model) pair."""

    name: str
    served_model_name: str
    kv_capacity_tokens: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # roofline inputs (docs/design/sim.md)
    llm_params: float
    vit_params: float
    weight_bytes: float
    kv_bytes_per_token: float
    num_layers: int
    hidden_size: int
    hbm_bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s
    mfu: float
    bw_efficiency: float
    step_overhead_s: float
    per_seq_overhead_s: float
    # extra host work of a step that computes any prompt tokens (prefill input and metadata setup), once
    # per step however many prompts it holds; negligible next to a GPU's prefill, a large part of a
    # tiny model's on a CPU
    prefill_step_overhead_s: float = 0.0
    # the API server's work on a request before the engine sees it (chat template, tokenizer, multimodal
    # processor), one request after another: a burst of arrivals reaches the scheduler staggered
    frontend_s: float = 0.0
    frontend_s_per_prompt_token: float = 0.0
    # what the vision tower hands the LLM per merged media token: the merged output plus Qwen3-VL's DeepStack
    # features (3 levels on the 8B/32B, 2 on the tiny model), each `hidden_size` bf16 values (encode role)
    vision_feature_levels: int = 4

    @property
    def encoder_bytes_per_token(self) -> float:
        return 2.0 * self.hidden_size * self.vision_feature_levels

    def with_overrides(self, **overrides: float | None) -> Preset:
        """A copy with the non-None fields replaced (command-line flags win over the preset)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def _kv_capacity(hbm_bytes: float, weight_bytes: float, kv_bytes_per_token: float,
                 utilization: float = 0.9, reserve_bytes: float = 4 * GB) -> int:
    return int((hbm_bytes * utilization - weight_bytes - reserve_bytes) // kv_bytes_per_token)


def _gpu_preset(name: str, served: str, *, hbm_bytes: float, hbm_bw: float, peak_flops: float,
                layers: int, kv_heads: int, head_dim: int, hidden: int, llm_params: float,
                vit_params: float, max_model_len: int) -> Preset:
    weight_bytes = 2 * (llm_params + vit_params)
    kv_per_token = _kv_bytes_per_token(layers, kv_heads, head_dim)
    return Preset(
        name=name, served_model_name=served,
        kv_capacity_tokens=_kv_capacity(hbm_bytes, weight_bytes, kv_per_token),
        block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=max_model_len,
        llm_params=llm_params, vit_params=vit_params, weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token, num_layers=layers, hidden_size=hidden,
        hbm_bandwidth=hbm_bw, peak_flops=peak_flops, mfu=0.5, bw_efficiency=0.8,
        step_overhead_s=0.002, per_seq_overhead_s=20e-6,
    )


def builtin_presets() -> dict[str, Preset]:
    """All presets by name (built on call: no state at import time)."""
    presets = [
        _gpu_preset("h100-qwen3-vl-8b", "Qwen/Qwen3-VL-8B-Instruct", hbm_bytes=80 * GB, hbm_bw=3.35e12,
                    peak_flops=989e12, layers=36, kv_heads=8, head_dim=128, hidden=4096,
                    llm_params=8.2e9, vit_params=0.58e9, max_model_len=32768),
        _gpu_preset("h200-qwen3-vl-32b", "Qwen/Qwen3-VL-32B-Instruct", hbm_bytes=141 * GB, hbm_bw=4.8e12,
                    peak_flops=989e12, layers=64, kv_heads=8, head_dim=128, hidden=5120,
                    llm_params=32.8e9, vit_params=0.58e9, max_model_len=32768),
        Preset(
            name="cpu-tiny", served_model_name="qwen3-vl-tiny",
            kv_capacity_tokens=4096, block_size=128, max_num_seqs=16, max_num_batched_tokens=2048,
            max_model_len=4096,
            # llm_params: the 1.0 M weights a token passes through (4 layers x 246 K); the other 2.3 M of
            # the checkpoint are embeddings (a lookup), the LM head (sampled tokens only) and the ViT
            llm_params=1.0e6, vit_params=1.0e6, weight_bytes=6.6e6,
            kv_bytes_per_token=_kv_bytes_per_token(4, 2, 64), num_layers=4, hidden_size=128,
            # effective rates of the one core vLLM binds its engine to (docs/design/sim.md, `cpu-tiny`)
            hbm_bandwidth=20e9, peak_flops=100e9, mfu=1.0, bw_efficiency=1.0,
            step_overhead_s=0.0034, per_seq_overhead_s=0.00017, prefill_step_overhead_s=0.005,
            frontend_s=0.001, frontend_s_per_prompt_token=6e-6, vision_feature_levels=3,
        ),
    ]
    return {p.name: p for p in presets}


def get_preset(name: str) -> Preset:
    presets = builtin_presets()
    if name not in presets:
        raise KeyError(f"unknown sim preset {name!r}; known: {', '.join(sorted(presets))}")
    return presets[name]
