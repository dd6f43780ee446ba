"""Run `kvroute` with routing constants replaced, for ablation runs of a policy's terms.

Owns only the launcher: `python -m bench.ablate MODULE.ATTR=VALUE ... -- proxy --port ...` sets
the attributes, then runs the normal CLI. proxy/** is not modified; the bench measures variants.
"""

from __future__ import annotations

import ast
import importlib
import sys

# short knob names used in route specs like "kv_aware@prefix_weight=0+hw=1.0" (see fleet.py)
MODULE_KNOBS = {
    "prefix_weight": "proxy.routing.kv_aware.PREFIX_WEIGHT",
    "queue_weight": "proxy.routing.kv_aware.QUEUE_WEIGHT",
    "prefix_saturation": "proxy.routing.kv_aware.PREFIX_SATURATION_TOKENS",
    "prefix_by_share": "proxy.routing.kv_aware.PREFIX_BY_SHARE",
    "backlog_weight": "proxy.routing.kv_aware.BACKLOG_WEIGHT",
    "cached_credit": "proxy.routing.kv_aware.CACHED_PREFILL_CREDIT",
    "credit_per_usage": "proxy.routing.kv_aware.CREDIT_PER_USAGE",
    "credit_per_share": "proxy.routing.kv_aware.CREDIT_PER_CACHE_SHARE",
    "inflight_weight": "proxy.routing.kv_aware.INFLIGHT_WEIGHT",
    "forget_after": "proxy.loadview.DISPATCH_FORGET_AFTER_S",
    "visible_after": "proxy.loadview.DISPATCH_VISIBLE_AFTER_S",
    "admit_after_output": "proxy.loadview.ADMIT_AFTER_OUTPUT",
    "admit_after_head": "proxy.loadview.ADMIT_AFTER_HEAD",
    "admit_above_kv": "proxy.loadview.ADMIT_AFTER_OUTPUT_ABOVE_KV",
    "admit_prefill": "proxy.loadview.ADMIT_AFTER_OUTPUT_PREFILL_TOKENS",
    "report_interval": "proxy.protocol.REPORT_INTERVAL_S",  # what the proxy asks of a small fleet (report_interval_for)
    # the proxy process's garbage collector (proxy/gctuning.py): gc_freeze=False+gc_gen0=700 is CPython's default
    "gc_freeze": "proxy.gctuning.FREEZE_AT_START",
    "gc_gen0": "proxy.gctuning.GEN0_THRESHOLD",
    "gc_gen1": "proxy.gctuning.GEN1_THRESHOLD",
    "gc_gen2": "proxy.gctuning.GEN2_THRESHOLD",
    # kv_cost (the time-unit model) and the estimator behind it
    "resolution": "proxy.routing.kv_cost.RESOLUTION_S",
    "shortlist": "proxy.routing.kv_cost.SHORTLIST",
    "prior_prefill_rate": "proxy.routing.estimator.PRIOR_PREFILL_TOKENS_PER_S",
    "prior_vision_extra": "proxy.routing.estimator.PRIOR_VISION_EXTRA",
    "forget": "proxy.routing.estimator.FORGET",
    "shrink_n": "proxy.routing.estimator.SHRINK_N",
}
CONFIG_KNOBS = {"hw": ("kv_high_water",), "queue_wait": ("queue", "max_wait_s"), "queue_len": ("queue", "max_length")}


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    for assignment in argv[:split]:
        target, _, value = assignment.partition("=")
        module_name, _, attr = target.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise SystemExit(f"{module_name} has no attribute {attr}")
        setattr(module, attr, ast.literal_eval(value))
    from proxy.cli import main as cli_main

    return cli_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
