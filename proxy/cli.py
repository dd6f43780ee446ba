"""The `kvroute` command: a thin dispatcher over subcommands.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only maps names to those modules. Command modules keep
their top-level imports light (no torch, no engines) so `kvroute --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("proxy.fleet.cmd_up", "launch the proxy and every worker in a config file, and keep the fleet equal to it"),
    "proxy": ("proxy.cmd_proxy", "run the proxy alone"),
    "worker": ("backends.cmd_worker", "run one worker: an engine plus its supervisor, registered with a proxy"),
    "status": ("proxy.fleet.cmd_status", "show the fleet behind a running proxy"),
    "scale": ("proxy.fleet.cmd_scale", "set the number of replicas of one model through the proxy"),
    "apply": ("proxy.fleet.cmd_apply", "send a config file to a running fleet (reconcile to it)"),
    "make-tiny-model": ("backends.tinymodel", "build a small randomly initialised Qwen3-VL checkpoint"),
    "bench": ("bench.cmd_bench", "run the benchmarks in bench/"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or (with `only`) one that imports just that subcommand's module."""
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware proxy for Qwen3-VL fleets")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # a command whose module is not built yet is simply not offered
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the command asked for, so one command's imports cannot break another.
    parser = build_parser(only=argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
