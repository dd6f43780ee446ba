"""What observability costs the proxy per request: CPU us/request with tracing off and on, and the access log.

Owns three kvroute variants on the same sim workers, run one after another and repeated: `quiet` (log
level warning: no access log, no tracing), `access-log` (log level info: one JSON line per request) and
`tracing` (access log and OTLP spans to a collector in this process that accepts and drops them).
`kvroute bench tracing [--requests N] [--repeats R] [--micro N]` (or `python -m bench.tracing_cost`); prints
a table, writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from tempfile import mkdtemp

from bench.fleet import KVROUTE, Fleet, SimWorkerSpec, _registered_workers
from bench.loadgen import LoadGenerator, RequestSpec, chat_body, summarize
from bench.peers import RunningRouter, spawn, wait_ready
from bench.procstat import ProcessTree

MODEL = "m"


class NullCollector:
    """OTLP/HTTP receiver that counts requests and drops them (its CPU is not the proxy's)."""

    def __init__(self) -> None:
        self.posts = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.posts += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_variant(fleet: Fleet, variant: str, collector: NullCollector, log_dir: Path) -> RunningRouter:
    port = fleet.proxy_port
    config = {"proxy": {"log_level": "warning" if variant == "quiet" else "info"}}
    if variant == "tracing":
        config["proxy"]["otlp_endpoint"] = collector.url
    cfg = log_dir / f"{variant}.yaml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    log_path = log_dir / f"kvroute-{variant}.log"
    popen = spawn([*KVROUTE, "proxy", "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
                   "--config", str(cfg)], log_path)
    router = RunningRouter(f"kvroute:{variant}", fleet.proxy_url, popen, log_path, ProcessTree(popen.pid))
    try:
        wait_ready(fleet.proxy_url, popen, log_path, timeout=60, path="/health")
        deadline = time.monotonic() + 60
        while _registered_workers(fleet.proxy_url) < len(fleet.urls):
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not register")
            time.sleep(0.1)
    except BaseException:
        router.stop()
        raise
    return router


def measure(fleet: Fleet, variant: str, requests: int, concurrency: int, collector: NullCollector,
            log_dir: Path) -> dict:
    router = start_variant(fleet, variant, collector, log_dir)
    try:
        def specs(n: int, tag: str) -> list[RequestSpec]:
            return [RequestSpec(chat_body(MODEL, [{"role": "user", "content": f"{tag} {i} hello"}], 4, False))
                    for i in range(n)]

        asyncio.run(LoadGenerator(router.url).closed_loop(specs(200, f"warm-{variant}"), concurrency))
        cpu0 = router.tree.cpu_seconds()
        run = asyncio.run(LoadGenerator(router.url).closed_loop(specs(requests, variant), concurrency))
        cpu1 = router.tree.cpu_seconds()
        row = summarize(run)
        return {"variant": variant, "ok": row["ok"], "failed": row["failed"],
                "cpu_us_per_req": (cpu1 - cpu0) / max(1, row["ok"]) * 1e6, "req_per_s": row["req_per_s"]}
    finally:
        router.stop()


def micro(n: int) -> None:
    """The same three variants in this process: the data plane's observability calls for one request
    (proxy/observability/request_watch.py, as journey.py makes them), CPU time per request, logs to a file."""
    import logging
    import os

    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from proxy.dataplane.outcome import Relayed
    from proxy.observability.accesslog import AccessLog
    from proxy.observability.decision import DebugGate
    from proxy.observability.otlp import encode_request
    from proxy.observability.request_watch import Observer
    from proxy.observability.tracing import Tracing

    class Dropped(SpanExporter):
        def __init__(self) -> None:
            self.cache: dict = {}

        def export(self, traces):  # the OTLP encoding is measured too (otlp.py), as OtlpHttpExporter does it
            encode_request(traces, self.cache)
            return SpanExportResult.SUCCESS

    class Req:
        def __init__(self) -> None:
            self.started = time.monotonic()
            self.principal = None
            self.index = {b"x-request-id": b"r-1", b"content-type": b"application/json",
                          b"traceparent": b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}

        def header(self, name: bytes) -> bytes | None:
            return self.index.get(name)

    log_path = Path(mkdtemp(prefix="kvroute-tracing-micro-")) / "access.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    access_logger = logging.getLogger("kvroute.access")
    access_logger.addHandler(handler)
    access_logger.propagate = False
    scores = {f"sim-{i}": 0.01 * (i + 1) for i in range(4)}
    gate = DebugGate(None, False)
    variants = {"quiet": (None, None), "access-log": (None, AccessLog()),
                "tracing": (Tracing(BatchSpanProcessor(Dropped(), max_queue_size=2 * n), whole_requests=True),
                            AccessLog())}
    for name, (tracing, access) in variants.items():
        access_logger.setLevel(logging.WARNING if access is None else logging.INFO)
        observer = Observer(tracing, access, gate)
        outcome = Relayed(200, time.monotonic())
        reqs = [Req() for _ in range(n)]
        cpu0 = time.process_time()
        for req in reqs:
            watch = observer.watch(req, b"127.0.0.1", "r-1")
            watch.parsed("m", False, None, 120)
            _run_now(watch.picking(_pick_now()))
            watch.decided("sim-1", "lowest_cost", scores, "kv_aware")
            watch.upstream("sim-1", "http://127.0.0.1:1")
            watch.attempt_ended(outcome)
            watch.finish()
        observer.close()  # the export thread's CPU (encoding) counts: process_time is every thread's
        cpu = (time.process_time() - cpu0) / n * 1e6
        print(f"| {name} (in-process, {n} requests) | {cpu:.1f} |", flush=True)
    os.unlink(log_path)


async def _pick_now() -> None:
    """A pick that admission answers at once (no holding)."""
    return None


def _run_now(awaitable) -> None:
    """Drive an awaitable that does not suspend to its end, without a loop."""
    try:
        awaitable.send(None)
    except StopIteration:
        return
    raise RuntimeError("the pick suspended")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--micro", type=int, default=0, metavar="N",
                   help="only the in-process measurement of the observability calls, N requests per variant")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    return run(p.parse_args())


def run(args: argparse.Namespace) -> int:
    if args.micro:
        print("| variant | CPU us/request |\n|---|---|")
        micro(args.micro)
        return 0
    log_dir = Path(mkdtemp(prefix="kvroute-tracing-cost-"))
    collector = NullCollector()
    rows: list[dict] = []
    spec = SimWorkerSpec(model=MODEL, preset="h100-qwen3-vl-8b", time_scale=1.15, extra=["--max-num-seqs", "512"])
    try:
        with Fleet(log_dir, [spec] * args.workers) as fleet:
            for r in range(args.repeats):
                order = ("quiet", "access-log", "tracing")
                for variant in order[r % 3:] + order[:r % 3]:  # each variant first once: drift spreads out
                    row = measure(fleet, variant, args.requests, args.concurrency, collector, log_dir)
                    print(f"[tracing-cost] repeat {r + 1} {variant}: {row}", flush=True)
                    rows.append(row)
    finally:
        collector.close()
    print("\n| variant | CPU us/request (each repeat) | median |\n|---|---|---|")
    for variant in ("quiet", "access-log", "tracing"):
        values = sorted(r["cpu_us_per_req"] for r in rows if r["variant"] == variant)
        print(f"| {variant} | {', '.join(f'{v:.0f}' for v in values)} | {values[len(values) // 2]:.0f} |")
    print(f"\n{args.requests} non-streamed requests (4 tokens) per run at concurrency {args.concurrency}, "
          f"{args.workers} sim workers; the collector received {collector.posts} OTLP batches. Logs: {log_dir}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
