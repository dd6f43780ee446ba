"""`kvroute worker --engine sim`: the simulator as a worker process.

Owns the command line's preset overrides, starting the HTTP server (server.py), registering with and
reporting to the proxy (backends/reporter.py), the KV-event publisher's life, the tokenizer hand-over, and
the drain on SIGTERM; not what the server answers (server.py) nor the engine (engine.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from backends.address import advertise_url
from backends.reporter import ProxyReporter, parse_proxy_urls
from backends.roles import role_labels, transfer_flag
from backends.sim.kv_publisher import SimKvEvents, kv_event_configs
from backends.sim.presets import Preset, get_preset
from backends.sim.server import SimServer
from proxy.protocol import WorkerRegistration

log = logging.getLogger("kvroute.sim.server")


def build_preset(args: argparse.Namespace) -> Preset:
    """The preset with command-line overrides; ValueError names the flag that is wrong."""
    try:
        preset = get_preset(args.preset)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    preset = preset.with_overrides(
        kv_capacity_tokens=args.kv_capacity_tokens, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    for flag, value in (("--block-size", preset.block_size), ("--max-num-seqs", preset.max_num_seqs),
                        ("--max-num-batched-tokens", preset.max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if preset.kv_capacity_tokens < preset.block_size:
        raise ValueError(f"--kv-capacity-tokens ({preset.kv_capacity_tokens}) must hold at least one block "
                         f"of {preset.block_size} tokens")
    if args.time_scale <= 0:
        raise ValueError(f"--time-scale must be positive, got {args.time_scale}")
    if not 0.0 <= args.fail_rate <= 1.0:
        raise ValueError(f"--fail-rate must be between 0 and 1, got {args.fail_rate}")
    return preset


async def serve(args: argparse.Namespace, preset: Preset) -> int:
    model = args.served_model_name or preset.served_model_name
    if args.slow_start > 0:
        log.info("--slow-start: waiting %.1fs before listening", args.slow_start)
        await asyncio.sleep(args.slow_start)
    kv_transfer = transfer_flag(args.kv_transfer, "--kv-transfer")
    counter = handover = None
    if getattr(args, "tokenizer", None):  # count as the real model does, and give the proxy the same tokenizer
        from backends.tokenizer_handover import TokenizerHandover
        from proxy.tokens.bundle import read_model_dir
        from proxy.tokens.counter import PromptCounter

        bundle = await asyncio.to_thread(read_model_dir, Path(args.tokenizer))
        if bundle is None:
            print(f"kvroute worker: error: no tokenizer.json in {args.tokenizer}", file=sys.stderr)
            return 2
        counter = await asyncio.to_thread(PromptCounter, bundle)
        handover = TokenizerHandover(bundle)
    server = SimServer(preset, model, time_scale=args.time_scale, seed=args.seed, fail_rate=args.fail_rate,
                       crash_after=args.crash_after, stall_after=args.stall_after, role=args.role,
                       kv_transfer=kv_transfer, ec_transfer=transfer_flag(args.ec_transfer, "--ec-transfer"),
                       counter=counter)
    runner = web.AppRunner(server.build_app(), access_log=None, handler_cancellation=True,
                            shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # real port when --port 0
    print(f"kvroute-sim listening on http://{args.host}:{port}", flush=True)
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    server.set_endpoint(args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1", port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    server.kv_events = SimKvEvents(server.engine, forward=bool(args.proxy_url) and not args.no_kv_events,
                                   configs=kv_event_configs(args.kv_events_config))
    await server.kv_events.start()
    reporter = None
    if args.proxy_url:
        # bound to 0.0.0.0: the address the route to the proxy leaves from (never 0.0.0.0 to dial)
        url = await asyncio.to_thread(advertise_url, args.advertise_url, args.host, port,
                                      parse_proxy_urls(args.proxy_url))
        if not loopback:  # other workers pull KV where the proxy reaches this one
            server.set_endpoint(urlsplit(url).hostname or args.host, port)
        registration = WorkerRegistration(
            worker_id=args.worker_id, url=url, models=[model], engine="sim",
            kv_capacity_tokens=server.engine.kv.num_blocks * server.engine.kv.block_size,
            max_model_len=server.engine.max_model_len, labels={
                "preset": preset.name, **role_labels(kv_transfer),
                # what crosses the link per token (the proxy's transfer-time predictions)
                "kv_bytes_per_token": str(int(preset.kv_bytes_per_token)),
                "encoder_bytes_per_token": str(int(preset.encoder_bytes_per_token))},
            role=args.role)
        reporter = ProxyReporter(args.proxy_url, registration, server.load_reading, token=args.proxy_token,
                                 kv_events=server.kv_events.mirror, on_registered=handover)
        await reporter.start()

    await stop.wait()
    log.info("stopping: draining %d in-flight requests (grace %.1fs)", server.in_flight, args.drain_grace_s)
    server.draining = True
    if reporter is not None:
        await reporter.set_state("draining")
    try:
        await asyncio.wait_for(server.idle.wait(), timeout=args.drain_grace_s)
    except TimeoutError:
        log.warning("drain grace over with %d requests in flight", server.in_flight)
    if reporter is not None:
        await reporter.stop()
    await server.kv_events.stop()
    await runner.cleanup()
    return 0


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        preset = build_preset(args)
        kv_event_configs(args.kv_events_config)
    except ValueError as exc:
        print(f"kvroute worker: error: {exc}", file=sys.stderr)
        return 2
    import uvloop

    return uvloop.run(serve(args, preset))
