"""`kvroute worker`: parse the worker's flags and hand over to the engine's entry point.

Owns the command line only. `--engine sim` runs the simulator in this process
(backends.sim.process.main); `--engine vllm|turbomind` runs the supervisor around the
engine's own OpenAI server (backends.worker.main). Arguments after `--` go to the engine.
"""

from __future__ import annotations

import argparse
import importlib
import os


class _ProxyUrls(argparse.Action):
    """`--proxy-url A --proxy-url B,C` -> "A,B,C" (the env default is replaced by the first flag)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        marker = f"_{self.dest}_given"
        current = getattr(namespace, self.dest, None) if getattr(namespace, marker, False) else None
        setattr(namespace, self.dest, f"{current},{values}" if current else str(values))
        setattr(namespace, marker, True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, choices=["sim", "vllm", "turbomind"])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port of the worker's OpenAI server; 0 = any free port")
    p.add_argument("--advertise-url", default=None,
                   help="URL the proxy should use to reach this worker (default http://HOST:PORT; with --host "
                        "0.0.0.0, HOST is the address this machine's route to the proxy leaves from)")
    p.add_argument("--served-model-name", default=None, help="model name clients ask for")
    p.add_argument("--proxy-url", default=os.environ.get("KVROUTE_PROXY_URL"), action=_ProxyUrls,
                   help="register with this proxy and report load to it (env KVROUTE_PROXY_URL); several "
                        "replicas: comma-separated or the flag repeated, and the worker moves to the next when "
                        "one stops answering; without it the worker runs standalone")
    p.add_argument("--proxy-token", default=os.environ.get("KVROUTE_WORKER_TOKEN"),
                   help="worker token for the proxy's control plane (env KVROUTE_WORKER_TOKEN)")
    p.add_argument("--worker-id", default=os.environ.get("KVROUTE_WORKER_ID"),
                   help="stable id to register under (env KVROUTE_WORKER_ID)")
    p.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long to wait for in-flight requests before stopping")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-kv-events", action="store_true",
                   help="do not forward the engine's KV-cache events to the proxy (it then infers what each engine "
                        "caches from what it routed there)")

    pd = p.add_argument_group("disaggregated serving (docs/design/disaggregation.md)")
    pd.add_argument("--role", default="both", choices=["both", "prefill", "decode", "encode"],
                    help="this worker's pool: both (default) serves whole requests; prefill, decode and encode "
                         "take their part of one")
    pd.add_argument("--kv-transfer", default=None, metavar="JSON",
                    help='how KV moves between pools: {"connector", "kv_role", "extra", "options", "link"} '
                         "(kvroute up passes its config's kv_transfer); vllm: becomes --kv-transfer-config")
    pd.add_argument("--ec-transfer", default=None, metavar="JSON",
                    help='how encoder output moves: {"connector", "extra", "options"}; vllm: --ec-transfer-config')

    sim = p.add_argument_group("sim engine")
    sim.add_argument("--preset", default="cpu-tiny", help="hardware/model preset (see backends/sim/presets.py)")
    sim.add_argument("--kv-capacity-tokens", type=int, default=None, help="KV cache size in tokens (preset's if unset)")
    sim.add_argument("--block-size", type=int, default=None, help="tokens per KV block (preset's if unset)")
    sim.add_argument("--max-num-seqs", type=int, default=None)
    sim.add_argument("--max-num-batched-tokens", type=int, default=None)
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="simulated seconds per wall second; 10 runs ten times faster than real time")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--fail-rate", type=float, default=0.0, help="fraction of requests answered with HTTP 500")
    sim.add_argument("--crash-after", type=int, default=None, help="exit abruptly after N requests")
    sim.add_argument("--stall-after", type=int, default=None, help="stop producing tokens after N requests")
    sim.add_argument("--slow-start", type=float, default=0.0, help="seconds before the server starts listening")
    sim.add_argument("--kv-events-config", default=None,
                     help="also publish the KV-cache events where vLLM's flag of this name would (JSON, e.g. "
                          "'{\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}'), for vllm-router's kv_aware policy")
    sim.add_argument("--tokenizer", default=None, metavar="DIR",
                     help="a checkpoint folder (tokenizer.json, chat template, processor config): the sim counts "
                          "prompts with it, exactly as vLLM would, and hands it to the proxy; default: its own rule")

    eng = p.add_argument_group("vllm / turbomind engines")
    eng.add_argument("--model", default=None, help="checkpoint path")
    eng.add_argument("--gpus", default=None, help="GPU ids, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES and tensor parallel size)")
    eng.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when --gpus is given")
    eng.add_argument("--engine-port", type=int, default=None, help="port of the engine's own server (default: free)")
    eng.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then arguments passed to the engine unchanged")


def run(args: argparse.Namespace) -> int:
    if args.engine_args and args.engine_args[0] == "--":
        args.engine_args = args.engine_args[1:]
    module = "backends.sim.process" if args.engine == "sim" else "backends.worker"
    return int(importlib.import_module(module).main(args) or 0)
