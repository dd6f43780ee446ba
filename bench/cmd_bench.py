"""`kvroute bench ...`: one subcommand per benchmark family, plus `peers` to install the peer routers.

Owns only the command line; each family's module (overhead, quality, scale, plot, headline, ...) does the work.
Heavy imports happen inside run() so `kvroute --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

FAMILIES: dict[str, tuple[str, str]] = {
    "overhead": ("bench.overhead", "router overhead vs direct calls on 4 fast sim workers (kvroute + peers)"),
    "quality": ("bench.quality", "routing quality matrix (issue 9): 6 workload families, closed loop and 50-110 percent load, kvroute vs peers vs an oracle"),
    "scale": ("bench.scale", "routing decision time at 10/100/1000 workers, prefix-index and per-stream memory"),
    "decision": ("bench.decision", "RoutingService.pick's time (admission, candidates, kv_aware/kv_cost) at 10/100/1000 "
                                   "workers with live reports and shared prefixes, p50/p99"),
    "chaos": ("bench.chaos", "issue 12's chaos run: SIGKILLs with restarts, SIGSTOP stalls, a 5xx worker and "
                             "(--state redis) a Redis restart under load; failures by kind, in-flight, fds, RSS"),
    "tracing": ("bench.tracing_cost", "CPU per request with the access log and OpenTelemetry tracing off and on"),
    "vllm-kv": ("bench.vllm_kv", "real vLLM CPU workers under KV pressure: kvroute vs peers over the same engines "
                                 "(failures, stalls declared, the engines' prefix hit rate, TTFT)"),
    "disagg": ("bench.disagg", "disaggregated serving on 8 sim GPUs: aggregated, fixed P/D splits, kvroute's "
                               "conditional disaggregation and vllm-router's PD mode; TTFT, ITL, goodput, KV moved"),
    "peers": ("bench.peers", "install vllm-router, sglang-router and LMDeploy's proxy into bench/.peers/"),
    "plot": ("bench.plot", "draw a quality or overhead result's plots (PNG) from its JSON into bench/.plots/"),
    "headline": ("bench.headline", "the performance summary from the result files: print it, or --write "
                                   "docs/performance.md and README.md's Performance tables"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="family", metavar="FAMILY", required=True)
    for name, (module_name, help_text) in FAMILIES.items():
        fp = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        if hasattr(module, "add_arguments"):
            module.add_arguments(fp)
        fp.set_defaults(_family_module=module_name)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so the `with Fleet(...)`/`finally` blocks stop every process
    # the bench started (workers, proxy, peers) by PID instead of leaving them running
    sys.exit(128 + signum)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    module = importlib.import_module(args._family_module)
    if args.family == "peers":
        return int(module.main() or 0)
    return int(module.run(args) or 0)
