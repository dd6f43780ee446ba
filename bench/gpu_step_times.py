"""The sim's step-time model against a GPU: one engine step of a Qwen3-VL-8B-shaped decoder, timed with torch.

Owns the measurement and its comparison with backends/sim/cost.py; nothing of kvroute runs. Needs a CUDA GPU
and torch (bf16, random weights: step time does not depend on the values). It builds the 36 decoder layers of
Qwen3-VL-8B's language model (hidden 4096, 32 query and 8 KV heads of 128, MLP 12288, vocabulary 151936),
each with its own weights, and times with CUDA events:
- a prefill step: a chunk of n new tokens of one sequence that already has c tokens of KV (flash/efficient
  attention, causal from the lower right), logits for its last token only;
- a decode step: b sequences of one new token each, each with c tokens of KV, logits for each.
What it leaves out, as the sim does: the vision tower, sampling, the engine's scheduling and its CUDA graphs
(so small decode steps measure launch overhead the engines partly hide); prefill repeats the KV heads
for the attention kernel (a copy the engines' kernels avoid). Each case: median of 7 timed runs
after 2 warm-ups.

The sim's prediction for the same step uses the preset's model with this GPU's memory bandwidth and peak
(`--peak-tflops`, `--hbm-tbps`; an H200 has the H100's bf16 peak and 4.8 TB/s).

Run (on a GPU): python -m bench.gpu_step_times --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

PREFILL_CASES = [(512, 0), (2048, 0), (8192, 0), (8192, 8192), (8192, 24576)]  # (new tokens, KV before)
DECODE_CASES = [(1, 1024), (32, 1024), (32, 8192), (128, 4096), (64, 16384)]  # (sequences, KV each)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS = 4096, 32, 8, 128, 12288, 151936, 36


def _measure(cases_prefill: list[tuple[int, int]], cases_decode: list[tuple[int, int]]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, dtype=dt) * 0.02)

    layers = [{"qkv": w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": w(HIDDEN, HEADS * HEAD_DIM),
               "gate_up": w(2 * MLP, HIDDEN), "down": w(HIDDEN, MLP), "n1": torch.ones(HIDDEN, device=dev, dtype=dt),
               "n2": torch.ones(HIDDEN, device=dev, dtype=dt)} for _ in range(LAYERS)]
    lm_head = w(VOCAB, HIDDEN)

    def layer(x: torch.Tensor, p: dict[str, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
              decode: bool) -> torch.Tensor:
        b, n, _ = x.shape
        h = F.rms_norm(x, (HIDDEN,), p["n1"])
        q, k, v = (h @ p["qkv"].T).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = q.view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v.view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
        if decode:
            # each KV head's 4 query heads as 4 queries of one head: GQA decode without copying the cache (the
            # step's own new token is left out of the keys: 1 of `context`)
            a = F.scaled_dot_product_attention(q.reshape(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), k_cache, v_cache)
            a = a.reshape(b, HEADS, 1, HEAD_DIM)
        else:
            keys, values = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
            keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
            values = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(n, keys.shape[2]))
        x = x + a.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM) @ p["o"].T
        h = F.rms_norm(x, (HIDDEN,), p["n2"])
        gate, up = (h @ p["gate_up"].T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ p["down"].T

    def step(batch: int, new: int, context: int) -> float:
        decode = new == 1
        x = w(batch, new, HIDDEN)
        kc = w(batch, KV_HEADS, context, HEAD_DIM)
        vc = w(batch, KV_HEADS, context, HEAD_DIM)

        def run() -> None:
            y = x
            for p in layers:
                y = layer(y, p, kc, vc, decode)
            (y[:, -1:, :] @ lm_head.T).float()

        times = []
        for i in range(9):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.no_grad():
                run()
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "prefill": [],
                           "decode": []}
    for new, context in cases_prefill:
        out["prefill"].append({"new": new, "context": context, "seconds": step(1, new, context)})
        print(f"prefill new={new} context={context}: {out['prefill'][-1]['seconds'] * 1e3:.1f} ms", flush=True)
    for seqs, context in cases_decode:
        out["decode"].append({"seqs": seqs, "context": context, "seconds": step(seqs, 1, context)})
        print(f"decode seqs={seqs} context={context}: {out['decode'][-1]['seconds'] * 1e3:.1f} ms", flush=True)
    return out


def sim_seconds(kind: str, a: int, context: int, peak_tflops: float, hbm_tbps: float) -> float:
    """The sim's step time for the same step on a preset with this GPU's peak and bandwidth."""
    from backends.sim.cost import StepWork, step_time_s
    from backends.sim.presets import get_preset

    preset = replace(get_preset("h100-qwen3-vl-8b"), peak_flops=peak_tflops * 1e12, hbm_bandwidth=hbm_tbps * 1e12)
    if kind == "prefill":
        work = StepWork(prefill_tokens=a, prefill_seqs=1, kv_tokens_read=context + a,
                        attention_pairs=a * context + a * (a + 1) // 2)
    else:
        work = StepWork(decode_seqs=a, kv_tokens_read=a * (context + 1))
    return step_time_s(preset, work)


def report(measured: dict[str, Any], peak_tflops: float, hbm_tbps: float) -> str:
    lines = [f"GPU {measured['gpu']}, torch {measured['torch']}; the sim's model at {peak_tflops:g} TFLOP/s bf16 "
             f"peak, {hbm_tbps:g} TB/s.", "", "| step | measured ms | sim ms | sim / measured |", "|---|---|---|---|"]
    for kind, a_key in (("prefill", "new"), ("decode", "seqs")):
        for row in measured[kind]:
            sim = sim_seconds(kind, row[a_key], row["context"], peak_tflops, hbm_tbps)
            label = (f"prefill {row['new']} new tokens after {row['context']}" if kind == "prefill"
                     else f"decode {row['seqs']} sequences of {row['context']} tokens")
            lines.append(f"| {label} | {row['seconds'] * 1e3:.1f} | {sim * 1e3:.1f} | {sim / row['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step_times", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the measurement (JSON) here")
    parser.add_argument("--report", type=Path, help="only compare a saved measurement with the sim")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--hbm-tbps", type=float, default=4.8)
    args = parser.parse_args(argv)
    if args.report:
        measured = json.loads(args.report.read_text())
    else:
        measured = _measure(PREFILL_CASES, DECODE_CASES)
        measured["host"] = platform.node()
        if args.out:
            args.out.write_text(json.dumps(measured, indent=1))
    print(report(measured, args.peak_tflops, args.hbm_tbps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
