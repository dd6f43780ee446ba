"""Hardware/model presets for the sim engine: KV size, batch limits and step-time constants.

Owns the numbers and where they come from; the step-time formula that uses them lives in cost.py.

Roofline derivation for the GPU presets (bf16 weights and KV, one GPU, no tensor parallelism):

    KV bytes per token   = 2 (K and V) x layers x kv_heads x head_dim x 2 bytes
    KV capacity (tokens) = (HBM x gpu_memory_utilization - weight bytes - activation reserve) / KV bytes per token
    memory time of step  = (weight bytes + KV tokens read x KV bytes per token) / (HBM bandwidth x bw_efficiency)
    compute time of step = (2 x LLM params x tokens in step + attention FLOPs + ViT FLOPs) / (peak bf16 FLOPs x mfu)
    step time            = fixed overhead + per-sequence overhead x seqs + max(memory time, compute time)

Constants and sources:
- NVIDIA H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA H100 datasheet).
- NVIDIA H200 SXM 141 GB: 4.8 TB/s HBM3e, 989 TFLOPS dense bf16 (NVIDIA H200 datasheet).
- Qwen3-VL-8B: LLM 36 layers, 8 KV heads, head_dim 128 (Qwen3-8B config.json), ~8.2 B LLM params,
  ~0.58 B vision tower; 144 KiB KV per token.
- Qwen3-VL-32B: LLM 64 layers, 8 KV heads, head_dim 128 (Qwen3-32B config.json), ~32.8 B LLM params,
  ~0.58 B vision tower; 256 KiB KV per token.
- Vision tower work: 16 px patches merged 2x2 into one LLM token, so each image token costs the ViT
  4 patches x 2 x ViT params FLOPs (attention inside the ViT ignored).
- Efficiencies (stated assumptions, typical of vLLM on Hopper): mfu 0.5 for prefill GEMMs, 0.8 of
  peak HBM bandwidth for decode, 2 ms fixed scheduler/launch overhead per step (CUDA graphs on
  for decode; the scheduler and sampler in Python), 20 us per sequence (sampling, detokenising).
- gpu_memory_utilization 0.9 (vLLM default), 4 GB reserved for activations and CUDA graphs.

`cpu-tiny` is not a roofline: it mimics the 3.3 M-parameter Qwen3-VL built by `kvroute make-tiny-model`
on vLLM CPU (shared/notes/engines.md): KV 4096 tokens in blocks of 128. vLLM binds its engine to one
of the 2 cores and leaves the other to the API server. Fitted to vLLM's own /metrics with
`python -m bench.sim_vs_vllm_cpu` (vLLM's figures over 5 runs of 3 rounds on 2026-11-29; real / sim, ms):
    mean inter-token gap, 1 stream           3.8-4.3 / 3.9-4.2
    mean inter-token gap, 8 streams          5.4-6.3 / 5.5-5.7  (closed loop: includes prefill steps)
    engine TTFT, 1 stream, ~250 tokens      15-21 / 19 (the sim counts ~300 tokens)
    engine TTFT, 8 streams, ~160 tokens     30-61 / 44-46
    prefill alone (vLLM's prefill-time histogram): 35 tokens 9.4, 274 tokens 14.9, 1301 tokens
    52.8; the formula gives 9.3, 14.8 and 51.4.
Constants: 3.4 ms per step and 0.17 ms per sequence (decode: 3.9 ms alone, 5.3 ms for 8); 5 ms more
for a step with prompt tokens, once per step (per prompt it would make a burst of 8 cost 8 x that,
where the real engine gives a burst of 8 a client TTFT p50 of 33 ms at best); 100 GFLOP/s over
the 1.0 M weights a token passes through and 4 x layers x hidden FLOPs per attention pair (0.02 ms
per prompt token, plus the quadratic part); an API front end of 1 ms + 6 us per prompt token per
request, one request at a time, so that a burst of 8 reaches the engine over ~15 ms. The sim then
serves one stream at ~235 tok/s and 8 at ~1250 tok/s (closed loop, 64-token answers).
The real server's client-side figures swing far more than its engine's: on the shared host its
API server delivers 40-80% of streams late, in one burst at the end (client TTFT p50 140-290 ms
where the engine's is 20 ms; 890-1240 tok/s at 8 clients). The sim does not model that.

Derived KV capacities: h100-qwen3-vl-8b 342,068 tokens (144 KiB each), h200-qwen3-vl-32b 214,157 tokens
(256 KiB each); one decode step alone takes ~8.6 ms and ~19.5 ms respectively (1000 tokens of context).
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
    # roofline inputs (see module docstring)
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
            # effective rates of the one core vLLM binds its engine to (see the docstring)
            hbm_bandwidth=20e9, peak_flops=100e9, mfu=1.0, bw_efficiency=1.0,
            step_overhead_s=0.0034, per_seq_overhead_s=0.00017, prefill_step_overhead_s=0.005,
            frontend_s=0.001, frontend_s_per_prompt_token=6e-6,
        ),
    ]
    return {p.name: p for p in presets}


def get_preset(name: str) -> Preset:
    presets = builtin_presets()
    if name not in presets:
        raise KeyError(f"unknown sim preset {name!r}; known: {', '.join(sorted(presets))}")
    return presets[name]
