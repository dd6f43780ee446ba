"""Sim preset `cpu-tiny` versus the real tiny Qwen3-VL on vLLM CPU: same workload, TTFT and throughput ratios.

Owns this one comparison; the load generator is bench/loadgen.py and the preset is
backends/sim/presets.py. Each engine runs alone (one after the other) so they do not share
the CPU, and is called directly, without the proxy. Run: `python -m bench.sim_vs_vllm_cpu`
(about 2 minutes; needs models/tiny-qwen3-vl, built by `make setup`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import LoadGenerator, RequestSpec, chat_body, summarize

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"
VLLM_ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", str(8 * 1024 * 1024), "--max-num-seqs", "16",
                    "--max-model-len", "2048"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / "models" / "tiny-qwen3-vl"))
    p.add_argument("--requests", type=int, default=48, help="requests per loaded phase (default 48)")
    p.add_argument("--concurrency", type=int, default=8, help="clients in the loaded phase (default 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the numbers to this file")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(count: int, max_tokens: int, seed_offset: int = 0) -> list[RequestSpec]:
    """Streaming chats with distinct ~100-token prompts (no prefix sharing between them)."""
    specs = []
    for i in range(count):
        words = " ".join(f"item{(i + seed_offset) * 7 + j}" for j in range(40))
        messages = [{"role": "user", "content": f"Request {i + seed_offset}: summarise {words}"}]
        specs.append(RequestSpec(body=chat_body(MODEL, messages, max_tokens, stream=True)))
    return specs


class Worker:
    """One `kvroute worker` process, started alone and stopped (its whole group) on exit."""

    def __init__(self, argv: list[str], log_path: Path, engine_args: list[str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = argv + ["--port", str(self.port)] + (["--", *engine_args] if engine_args else [])
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Worker:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"worker not ready after 300 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    gen = LoadGenerator(url)
    await gen.closed_loop(workload(4, 8, 10_000), 2)  # warm-up: first requests pay one-off costs
    single = summarize(await gen.closed_loop(workload(12, args.max_tokens, 20_000), 1))
    loaded = summarize(await gen.closed_loop(workload(args.requests, args.max_tokens), args.concurrency))
    return {"ttft_p50_c1": single["ttft_p50"], "tok_s_c1": single["output_tok_per_s"],
            "ttft_p50_loaded": loaded["ttft_p50"], "tok_s_loaded": loaded["output_tok_per_s"],
            "failed": single["failed"] + loaded["failed"]}


def run(args: argparse.Namespace) -> int:
    python = [sys.executable, "-m", "proxy.cli", "worker"]
    logs = Path(tempfile.mkdtemp(prefix="kvroute-sim-vs-vllm-"))
    results: dict[str, dict[str, Any]] = {}
    vllm_argv = [*python, "--engine", "vllm", "--model", args.model_dir, "--device", "cpu",
                 "--served-model-name", MODEL]
    with Worker(vllm_argv, logs / "vllm.log", VLLM_ENGINE_ARGS) as w:
        results["vllm-cpu"] = asyncio.run(measure(w.url, args))
    sim_argv = [*python, "--engine", "sim", "--preset", "cpu-tiny", "--served-model-name", MODEL]
    with Worker(sim_argv, logs / "sim.log") as w:
        results["sim cpu-tiny"] = asyncio.run(measure(w.url, args))

    real, sim = results["vllm-cpu"], results["sim cpu-tiny"]
    ratios = {k: (sim[k] / real[k] if real[k] else None) for k in ("ttft_p50_c1", "tok_s_c1", "ttft_p50_loaded",
                                                                     "tok_s_loaded")}
    print(f"workload: streaming chat, ~100-token prompts, {args.max_tokens} output tokens; "
          f"1 client x 12 requests, then {args.concurrency} clients x {args.requests} requests")
    print(f"{'':14} {'TTFT p50 c=1':>13} {'tok/s c=1':>10} {'TTFT p50 c=' + str(args.concurrency):>13} "
          f"{'tok/s c=' + str(args.concurrency):>10}")
    for name, r in results.items():
        print(f"{name:14} {r['ttft_p50_c1'] * 1000:>10.1f} ms {r['tok_s_c1']:>10.0f} "
              f"{r['ttft_p50_loaded'] * 1000:>10.1f} ms {r['tok_s_loaded']:>10.0f}")
    print("sim / real     " + "  ".join(f"{k}={v:.2f}" for k, v in ratios.items() if v is not None))
    off = [k for k, v in ratios.items() if v is not None and abs(v - 1) > 0.25]
    print("within 25%" if not off else f"off by more than 25%: {', '.join(off)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
