"""What reading a vLLM engine's load costs the engine, and how soon a request shows in that load.

Two measurements on the real tiny Qwen3-VL served by vLLM CPU (one `vllm.entrypoints.openai.api_server`,
started and stopped here), the figures behind the report path's defaults:

1. Scrape cost: CPU seconds of the vLLM server's process tree per `/metrics` read, in full (what any
   Prometheus scraper gets) and filtered to the samples a kvroute worker parses (`/metrics/?name[]=...`,
   backends/engines/base.MetricsReader), over back-to-back reads, less what the idle server used over
   the same wall time. Protocol.REPORT_INTERVAL_S (20 Hz) multiplies it into a share of a core.
2. Front-end delay: requests sent one at a time to the idle engine (short text, long text, one image),
   the time from sending until the engine's `/metrics` counts it (running + waiting up by one, polled
   with filtered reads), and until its stream's response head and first token arrive. The proxy's
   `proxy.routing.admission.dispatch_visible_after_s` assumes a report that reaches it this long after a
   dispatch shows that request; the sim's front end (backends/sim/presets.py) models the same delay.

The host's CPU is the API server's CPU on a GPU machine too (tokenizing, image preprocessing), but these
2 shared cores are slower than a server's: read the figures as an order of magnitude. Run:
`python -m bench.vllm_report_path` (~2 min; needs models/tiny-qwen3-vl, built by `make setup`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from backends.engines.vllm import METRIC_NAMES, RUNNING, WAITING
from bench.loadgen import carries_token
from bench.procstat import ProcessTree
from bench.report import environment_note, results_path
from bench.sim_vs_vllm_cpu import MODEL, REPO, VLLM_ENGINE_ARGS, Worker
from proxy import promtext

FILTER = [("name[]", name) for name in METRIC_NAMES]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=str(REPO / "models" / "tiny-qwen3-vl"))
    p.add_argument("--scrapes", type=int, default=300, help="reads per scrape-cost cell (default 300)")
    p.add_argument("--requests", type=int, default=20, help="requests per front-end cell (default 20)")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--name", default="vllm-report-path")


def _png(side: int) -> str:
    from PIL import Image  # transformers' image processors need Pillow: it is there wherever vLLM is

    image = Image.new("RGB", (side, side))
    image.putdata([((x * 7) % 256, (y * 5) % 256, (x * y) % 256) for y in range(side) for x in range(side)])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def requests_by_kind() -> dict[str, list[dict[str, Any]]]:
    image = _png(448)
    kinds: dict[str, list[dict[str, Any]]] = {"short text": [], "long text": [], "image 448x448": []}
    for i in range(1000):
        kinds["short text"].append({"role": "user", "content": f"q{i} " + " ".join(f"w{i}x{j}" for j in range(40))})
        kinds["long text"].append({"role": "user", "content": f"q{i} " + " ".join(f"w{i}x{j}" for j in range(200))})
        kinds["image 448x448"].append({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": f"q{i}: what is it?"}]})
    return {kind: [{"model": MODEL, "messages": [m], "max_tokens": 4, "stream": True} for m in msgs]
            for kind, msgs in kinds.items()}


async def scrape_cost(session: aiohttp.ClientSession, url: str, tree: ProcessTree, reads: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, path, params in (("idle", "", None), ("full", "/metrics", []), ("filtered", "/metrics/", FILTER)):
        cpu0, t0, size = tree.cpu_seconds(), time.monotonic(), 0
        if params is None:
            await asyncio.sleep(out["full"]["wall_s"] if out else 3.0)
        else:
            for _ in range(reads):
                async with session.get(url + path, params=params or None,
                                       headers={"Accept-Encoding": "identity"}) as resp:
                    size = len(await resp.read())
        out[label] = {"cpu_s": tree.cpu_seconds() - cpu0, "wall_s": time.monotonic() - t0, "bytes": size}
    for label in ("full", "filtered"):
        cell = out[label]
        idle_cpu = out["idle"]["cpu_s"] * cell["wall_s"] / out["idle"]["wall_s"]
        cell["ms_per_read"] = max(0.0, cell["cpu_s"] - idle_cpu) / reads * 1000
        cell["core_share_at_20hz"] = cell["ms_per_read"] * 20 / 1000
    return out


async def _counted(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/metrics/", params=FILTER) as resp:
        metrics = promtext.parse(await resp.text(), names=(RUNNING, WAITING))
    return int((metrics.total(RUNNING) or 0) + (metrics.total(WAITING) or 0))


async def front_end_delay(session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    visible, head, first, poll_gap, prompt_tokens = [], [], [], [], []
    for body in bodies:
        # wait until the previous request has left the engine: only /metrics says so
        while await _counted(session, url):  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        marks: dict[str, float] = {}

        async def send(body: dict[str, Any] = body, marks: dict[str, float] = marks) -> None:
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                marks["head"] = time.monotonic()
                if resp.status != 200:
                    raise RuntimeError(f"the engine answered {resp.status}: {(await resp.text())[:300]}")
                async for line in resp.content:  # the first token's chunk, not the first bytes
                    if line.startswith(b"data: {") and carries_token(json.loads(line[6:])):
                        marks.setdefault("first", time.monotonic())

        t0 = time.monotonic()
        task = asyncio.create_task(send())
        last = t0
        while "visible" not in marks and time.monotonic() - t0 < 10:
            asked = time.monotonic()
            if await _counted(session, url):
                marks["visible"] = asked  # the engine counted it by the time this read was asked for
                poll_gap.append(asked - last)
            last = asked
        await task
        visible.append(marks.get("visible", float("nan")) - t0)
        head.append(marks["head"] - t0)
        first.append(marks["first"] - t0)

    def ms(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"p50": statistics.median(ordered) * 1000, "p90": ordered[int(0.9 * (len(ordered) - 1))] * 1000,
                "max": ordered[-1] * 1000}

    async with session.post(f"{url}/tokenize", json={"model": MODEL, "messages": bodies[0]["messages"]}) as resp:
        prompt_tokens.append((await resp.json()).get("count"))
    return {"visible_ms": ms(visible), "head_ms": ms(head), "first_token_ms": ms(first),
            "poll_gap_ms": ms(poll_gap or [0.0]), "prompt_tokens": prompt_tokens[0]}


async def measure(args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    assert worker.proc is not None
    tree = ProcessTree(worker.proc.pid)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), headers=worker.headers) as session:
        kinds = requests_by_kind()
        for body in [b for bodies in kinds.values() for b in bodies[-3:]]:  # warm-up, not counted
            async with session.post(f"{worker.url}/v1/chat/completions", json=body) as resp:
                await resp.read()
        result: dict[str, Any] = {"scrape": await scrape_cost(session, worker.url, tree, args.scrapes), "front_end": {}}
        for kind, bodies in kinds.items():
            result["front_end"][kind] = await front_end_delay(session, worker.url, bodies[:args.requests])
    return result


def render(result: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    lines = ["# vLLM report path: scrape cost and front-end delay", "", f"{environment_note()}. Command: `{command}`", "",
             f"vLLM CPU, tiny Qwen3-VL, `{' '.join(VLLM_ENGINE_ARGS)}`. Scrape cost: {args.scrapes} reads per row, "
             "CPU of the server's process tree less its idle CPU over the same wall time.", "",
             "| /metrics read | bytes | engine CPU ms per read | share of a core at 20 Hz |", "|---|---|---|---|"]
    for label in ("full", "filtered"):
        cell = result["scrape"][label]
        lines.append(f"| {label} | {cell['bytes']} | {cell['ms_per_read']:.2f} | {cell['core_share_at_20hz']:.1%} |")
    lines += ["", f"Front-end delay: {args.requests} requests per row, one at a time on the idle engine, "
              "ms from sending (p50 / p90 / max).", "",
              "| request | prompt tokens | counted in /metrics | response head | first token | poll gap |",
              "|---|---|---|---|---|---|"]
    for kind, cell in result["front_end"].items():
        def fmt(d: dict[str, float]) -> str:
            return f"{d['p50']:.1f} / {d['p90']:.1f} / {d['max']:.1f}"
        lines.append(f"| {kind} | {cell['prompt_tokens']} | {fmt(cell['visible_ms'])} | {fmt(cell['head_ms'])} | "
                     f"{fmt(cell['first_token_ms'])} | {cell['poll_gap_ms']['p50']:.1f} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    command = "python -m bench.vllm_report_path " + " ".join(sys.argv[1:])
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_dir,
            "--served-model-name", MODEL, "--host", "127.0.0.1", *VLLM_ENGINE_ARGS]
    out_dir = Path(args.out_dir)
    log = results_path(args.name, ".log", out_dir)
    with Worker(argv, log) as worker:
        result = asyncio.run(measure(args, worker))
    results_path(args.name, ".json", out_dir).write_text(json.dumps(result, indent=1))
    report = render(result, args, command)
    results_path(args.name, ".md", out_dir).write_text(report)
    log.unlink(missing_ok=True)
    print(report)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
