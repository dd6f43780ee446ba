"""Step-time model of the sim engine: how long one forward pass of a scheduled batch takes.

Owns the formula only (a roofline: the slower of compute and memory traffic, plus overheads);
the constants come from presets.py and the batch shape from scheduler.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.sim.presets import Preset


@dataclass(frozen=True)
class StepWork:
    """What one engine step computes."""

    prefill_tokens: int = 0  # prompt (or recomputed) tokens computed this step
    decode_seqs: int = 0  # sequences generating one token this step
    prefill_seqs: int = 0  # sequences with a prefill chunk this step
    kv_tokens_read: int = 0  # KV entries read by attention, summed over the step's sequences
    attention_pairs: int = 0  # (query token, key token) pairs: the quadratic part of prefill
    image_tokens: int = 0  # image/video tokens whose vision encoding happens this step

    @property
    def num_seqs_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


def step_time_s(preset: Preset, work: StepWork) -> float:
    """Seconds one step takes on the preset's hardware.

    compute = 2 x LLM params per token + 4 x layers x hidden per attention pair
              + 8 x ViT params per image token (4 patches per merged token, 2 FLOPs per param)
    memory  = all weights once + KV tokens read x KV bytes per token
    time    = fixed overhead + per-sequence overhead + prefill overhead (if any prompt tokens)
              + max(compute / (peak x mfu), memory / (bw x eff))
    """
    tokens = work.num_seqs_tokens
    if tokens == 0 and work.image_tokens == 0:
        return 0.0
    flops = (2.0 * preset.llm_params * tokens
             + 4.0 * preset.num_layers * preset.hidden_size * work.attention_pairs
             + 8.0 * preset.vit_params * work.image_tokens)
    memory_bytes = preset.weight_bytes + work.kv_tokens_read * preset.kv_bytes_per_token
    compute_s = flops / (preset.peak_flops * preset.mfu)
    memory_s = memory_bytes / (preset.hbm_bandwidth * preset.bw_efficiency)
    num_seqs = work.decode_seqs + work.prefill_seqs
    return (preset.step_overhead_s + preset.per_seq_overhead_s * num_seqs
            + (preset.prefill_step_overhead_s if work.prefill_seqs else 0.0) + max(compute_s, memory_s))
