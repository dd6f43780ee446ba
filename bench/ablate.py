"""Run `kvroute` with the proxy's process settings replaced: the garbage collector and the report interval.

Owns only that launcher: `python -m bench.ablate MODULE.ATTR=VALUE ... -- proxy --port ...` sets the attributes,
then runs the normal CLI. These settings are the process's, not routing's, so no config key holds them (routing
and admission knobs are config keys: bench/route_spec.py writes them into the proxy's config file); only the
attributes named in PROCESS_KNOBS may be set.
"""

from __future__ import annotations

import ast
import importlib
import sys

# route spec knob -> the attribute it sets, e.g. "kv_aware@report_interval=0.1+gc_freeze=False"
PROCESS_KNOBS = {
    "report_interval": "proxy.protocol.REPORT_INTERVAL_S",  # what the proxy asks of a small fleet (report_interval_for)
    # the proxy process's garbage collector (proxy/gctuning.py): gc_freeze=False+gc_gen0=700 is CPython's default
    "gc_freeze": "proxy.gctuning.FREEZE_AT_START",
    "gc_gen0": "proxy.gctuning.GEN0_THRESHOLD",
    "gc_gen1": "proxy.gctuning.GEN1_THRESHOLD",
    "gc_gen2": "proxy.gctuning.GEN2_THRESHOLD",
}


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    allowed = set(PROCESS_KNOBS.values())
    for assignment in argv[:split]:
        target, _, value = assignment.partition("=")
        if target not in allowed:
            raise SystemExit(f"{target} is not a process setting ({', '.join(sorted(allowed))}); routing and "
                             "admission knobs are config keys (proxy.routing)")
        module_name, _, attr = target.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise SystemExit(f"{module_name} has no attribute {attr}")
        setattr(module, attr, ast.literal_eval(value))
    from proxy.cli import main as cli_main

    return cli_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
