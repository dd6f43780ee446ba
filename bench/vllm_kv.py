"""Real vLLM CPU workers under KV pressure: kvroute against the peer routers over the same engines, in one run.

Owns this one benchmark: N `kvroute worker --engine vllm` processes (the tiny Qwen3-VL, a small KV cache,
prefix caching on, each on its own core as each would have its own GPU, warmed up before the first cell) that
stay up for the whole run, and per cell one router in front of them. The workload:
a few long shared system prompts, each request one of them plus a short question, streamed, closed loop
at high concurrency; the prompts are salted per cell, so every cell starts cold on every engine. Measured
per cell: failures and refusals, makespan, TTFT p50/p99 (to the first generated token), the engines' own
prefix-cache hit rate and preemptions (from their /metrics), and for kvroute the workers it declared
stalled, those that looked stalled but were kept (the last of their model) and the circuits it opened (from
its log). Cells are interleaved route by route within a repeat, each repeat starting one route later.
Run: `python -m bench.vllm_kv` (`--help` for the knobs); results go to bench/results/<date>-<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.fleet import KVROUTE, free_port, resolve_default, scrape_metrics, start_kvroute
from bench.loadgen import LoadGenerator, RequestSpec, chat_body, summarize
from bench.peers import RunningRouter, spawn, start_peer, stop_process_group, wait_ready
from bench.report import environment_note, fmt, md_table, ms, results_path, write_json
from bench.traces import BLOCK_TOKENS, BlockVocabulary, TraceRequest, render_prompt

MODEL = "qwen3-vl-tiny"
REPO = Path(__file__).resolve().parents[1]
STALL_LINE = re.compile(r"worker \S+ .*moving its requests")
KEPT_LINE = re.compile(r"worker \S+ looks stalled")  # the last worker of its model: its requests waited
BREAKER_LINE = re.compile(r"circuit opened for ")


class VllmFleet:
    """vLLM CPU workers under `kvroute worker`, reporting to a proxy port that kvroute cells listen on."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args, self.log_dir = args, log_dir
        self.proxy_port = free_port()
        self.api_key = secrets.token_urlsafe(16)  # the engines' key: peers get it from the client's header
        self.urls: list[str] = []
        self._procs: list[Any] = []

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def __enter__(self) -> VllmFleet:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it overrides the bytes below
        env["VLLM_API_KEY"] = self.api_key
        engine = ["--kv-cache-memory-bytes", str(self.args.kv_cache_bytes), "--max-num-seqs",
                  str(self.args.max_num_seqs), "--enforce-eager", "--enable-prefix-caching",
                  "--max-model-len", str(self.args.max_model_len)]
        try:
            for i in range(self.args.workers):
                port = free_port()
                if self.args.engine_cores == "spread":  # one core each, as each engine would have its own GPU
                    env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
                argv = [*KVROUTE, "worker", "--engine", "vllm", "--model", str(self.args.model_dir), "--device", "cpu",
                        "--served-model-name", MODEL, "--port", str(port), "--proxy-url", self.proxy_url,
                        "--worker-id", f"vllm-{i}", "--log-level", "warning", "--", *engine]
                self._procs.append(spawn(argv, self.log_dir / f"vllm-{i}.log", env=env))
                self.urls.append(f"http://127.0.0.1:{port}")
            for i, (url, proc) in enumerate(zip(self.urls, self._procs, strict=True)):
                wait_ready(url, proc, self.log_dir / f"vllm-{i}.log", timeout=600, path="/health")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            stop_process_group(proc, timeout=40)
        self._procs.clear()

    def counters(self) -> list[dict[str, float]]:
        return [scrape_metrics(u, timeout=10) for u in self.urls]


def workload(args: argparse.Namespace, vocab: BlockVocabulary, salt: str) -> list[RequestSpec]:
    """`requests` chats over `prompts` shared system prompts of `prompt_tokens` one-token words, salted."""
    rng = random.Random(f"{args.seed}/{salt}")
    systems = [system_prompt(vocab, p, args.prompt_tokens, salt) for p in range(args.prompts)]
    weights = [1.0 / (p + 1) ** args.zipf for p in range(args.prompts)]
    specs = []
    for i in range(args.requests):
        p = rng.choices(range(args.prompts), weights)[0]
        question = " ".join(rng.choices(vocab.words, k=args.question_tokens))
        messages = [{"role": "system", "content": systems[p]}, {"role": "user", "content": f"{i}: {question}"}]
        specs.append(RequestSpec(chat_body(MODEL, messages, args.max_tokens, True), tag=f"p{p}"))
    return specs


def system_prompt(vocab: BlockVocabulary, index: int, tokens: int, salt: str) -> str:
    """Shared prompt `index`: `tokens` one-token words, rendered as a trace's prompt of that many blocks."""
    blocks = tuple(index * 1000 + b for b in range(-(-tokens // BLOCK_TOKENS)))
    return render_prompt(TraceRequest(0.0, tokens, 0, blocks), vocab, salt, {})


def warm_up(fleet: VllmFleet, args: argparse.Namespace, vocab: BlockVocabulary) -> None:
    """A whole cell's workload, unmeasured, before the first cell, every engine serving its share at once at the
    cells' concurrency: a CPU engine's first batches of a new shape are slow, and whichever route ran first would
    pay for them (the route order also turns with each repeat, run())."""
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    specs = workload(args, vocab, "warm-up")
    n = len(fleet.urls)

    async def serve_all() -> None:
        await asyncio.gather(*(LoadGenerator(url, timeout_s=args.timeout_s, headers=headers).closed_loop(
            specs[i::n], max(1, args.concurrency // n)) for i, url in enumerate(fleet.urls)))

    asyncio.run(serve_all())


def _delta(after: list[dict[str, float]], before: list[dict[str, float]], name: str) -> list[float]:
    return [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True)]


def start_route(route: str, fleet: VllmFleet) -> RunningRouter:
    kind, _, policy = route.partition(":")
    if kind == "kvroute":  # start_kvroute reads a fleet's proxy_url, proxy_port, log_dir and urls
        return start_kvroute(fleet, resolve_default(policy or "default"), timeout=120)  # type: ignore[arg-type]
    return start_peer(kind, policy, fleet.urls, free_port(), free_port(), fleet.log_dir,
                      headers={"Authorization": f"Bearer {fleet.api_key}"})


def run_cell(route: str, fleet: VllmFleet, args: argparse.Namespace, vocab: BlockVocabulary,
             salt: str) -> dict[str, Any]:
    router = start_route(route, fleet)
    try:
        log_start = router.log_path.stat().st_size if router.log_path.exists() else 0
        before = fleet.counters()
        gen = LoadGenerator(router.url, timeout_s=args.timeout_s,
                            headers={"Authorization": f"Bearer {fleet.api_key}"})
        result = asyncio.run(gen.closed_loop(workload(args, vocab, salt), args.concurrency))
        after = fleet.counters()
        log = router.log_path.read_text(errors="replace")[log_start:] if router.log_path.exists() else ""
        predictions = _cache_predictions(router.url) if route.startswith("kvroute") else None
    finally:
        router.stop()
    row = summarize(result)
    queries = _delta(after, before, "vllm:prefix_cache_queries_total")
    hits = _delta(after, before, "vllm:prefix_cache_hits_total")
    row.update(route=route, salt=salt, makespan_s=result.wall_s,
               prefix_hit=sum(hits) / sum(queries) if sum(queries) else None,
               prefix_hit_by_worker=[h / q if q else None for h, q in zip(hits, queries, strict=True)],
               preemptions=sum(_delta(after, before, "vllm:num_preemptions_total")),
               stalls_declared=len(STALL_LINE.findall(log)), stalls_kept=len(KEPT_LINE.findall(log)),
               circuits_opened=len(BREAKER_LINE.findall(log)),
               errors_seen=sorted({r.error or str(r.status) for r in result.results if not r.ok})[:5],
               # where each shared prompt went (kvroute names the worker in x-kvroute-worker; peers do not)
               workers_by_prompt=_workers_by_prompt(result.results), cache_predictions=predictions)
    return row


def _workers_by_prompt(results: list[Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in results:
        if r.worker:
            by_worker = out.setdefault(r.tag, {})
            by_worker[r.worker] = by_worker.get(r.worker, 0) + 1
    return dict(sorted(out.items()))


def _cache_predictions(url: str) -> dict[str, Any] | None:
    """kvroute's own view of its accuracy: per worker, the cached tokens it predicted against those reported."""
    try:
        workers = httpx.get(url + "/workers", timeout=10).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return {w["worker_id"]: w.get("cache_prediction") for w in workers}


def _mean_spread(rows: list[dict[str, Any]], key: str, scale: float = 1.0, digits: int = 0) -> str:
    xs = [r[key] * scale for r in rows if r.get(key) is not None]
    if not xs:
        return "-"
    mean = statistics.fmean(xs)
    return f"{mean:.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})" if len(xs) > 1 else f"{mean:.{digits}f}"


def render(data: dict[str, Any]) -> str:
    a = data["args"]
    out = [f"# Real vLLM CPU under KV pressure: {data['name']}", "", environment_note() + ".",
           f"Command: `{data['command']}`", "",
           f"{a['workers']} vLLM CPU workers (tiny Qwen3-VL, KV {a['kv_cache_bytes'] // 2**20} MiB each, "
           f"max-num-seqs {a['max_num_seqs']}, prefix caching on); {a['requests']} streamed chats per cell at "
           f"concurrency {a['concurrency']}: {a['prompts']} shared system prompts of {a['prompt_tokens']} tokens "
           f"(Zipf {a['zipf']}), a {a['question_tokens']}-token question, {a['max_tokens']} output tokens; prompts "
           f"salted per cell; engine cores: {a.get('engine_cores', 'auto')}. Mean (min-max) over {a['repeats']} repeats; times in ms.", ""]
    headers = ["route", "failed", "refused", "makespan (s)", "TTFT p50", "TTFT p99", "engines' prefix hit (%)",
               "preemptions", "stalls declared", "looked stalled, kept", "circuits opened"]
    rows = []
    for route in a["routes"]:
        rs = [r for r in data["rows"] if r["route"] == route]
        rows.append([route, _mean_spread(rs, "failed", digits=1), _mean_spread(rs, "rejected", digits=1),
                     _mean_spread(rs, "makespan_s", digits=1), _mean_spread(rs, "ttft_p50", 1000),
                     _mean_spread(rs, "ttft_p99", 1000), _mean_spread(rs, "prefix_hit", 100, 1),
                     _mean_spread(rs, "preemptions", digits=1), _mean_spread(rs, "stalls_declared", digits=1),
                     _mean_spread(rs, "stalls_kept", digits=1), _mean_spread(rs, "circuits_opened", digits=1)])
    out.append(md_table(headers, rows))
    out += [f"- cell not run: {failure}" for failure in data.get("failed_cells", [])]
    out += ["", "Per cell:", ""]
    out.append(md_table(["repeat", "route", "ok", "failed", "makespan (s)", "TTFT p99", "hit (%)", "stalls"],
                        [[r["repeat"], r["route"], r["ok"], r["failed"], fmt(r["makespan_s"]), ms(r["ttft_p99"]),
                          fmt(r["prefix_hit"] * 100 if r["prefix_hit"] is not None else None),
                          r["stalls_declared"]] for r in data["rows"]]))
    predicted = [r for r in data["rows"] if r.get("cache_predictions")]
    if predicted:
        out += ["", "kvroute's predictions per cell: cached prompt tokens it predicted for the chosen worker against "
                "those the engine reported reusing (answers compared; GET /workers `cache_prediction`):", ""]
        out.append(md_table(["repeat", "route", "worker", "answers", "predicted", "actual", "mean abs error"],
                            [[r["repeat"], r["route"], wid, c["answers"], c["predicted_tokens"], c["actual_tokens"],
                              c["mean_abs_error_tokens"]]
                             for r in predicted for wid, c in sorted(r["cache_predictions"].items()) if c]))
    return "\n".join(out) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routes", default="kvroute:default,sglang-router:cache_aware",
                   help="comma-separated kvroute:POLICY / PEER:POLICY (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kv-cache-bytes", type=int, default=12 * 2**20, help="per engine (8 MiB: 4096 tokens)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=6, help="shared system prompts")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per system prompt")
    p.add_argument("--zipf", type=float, default=0.6, help="popularity skew of the system prompts")
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--engine-cores", choices=("spread", "auto"), default="spread",
                   help="spread: engine i computes on core i (mod the cores), apart as GPUs are; auto: vLLM's own "
                        "binding (every engine on the same core here)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request, client side")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny-qwen3-vl")
    p.add_argument("--name", default="vllm-kv")
    p.add_argument("--out-dir", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    routes = [r for r in args.routes.split(",") if r]
    log_dir = Path(os.environ.get("KVROUTE_BENCH_LOGS") or REPO / "bench" / ".runs" / f"vllm-kv-{int(time.time())}")
    log_dir.mkdir(parents=True, exist_ok=True)
    vocab = BlockVocabulary(args.model_dir)
    data: dict[str, Any] = {"name": args.name, "command": "kvroute bench vllm-kv " + " ".join(sys.argv[3:]),
                            "args": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                        if not k.startswith("_") and k != "family"}, "routes": routes}, "rows": []}
    t0 = time.time()
    with VllmFleet(args, log_dir) as fleet:
        warm_up(fleet, args, vocab)
        for repeat in range(args.repeats):
            turn = repeat % len(routes)  # each route goes first in turn: no route always meets the run's start
            for route in routes[turn:] + routes[:turn]:
                try:
                    row = run_cell(route, fleet, args, vocab, salt=f"r{repeat}-{route}")
                except Exception as exc:  # one router that does not come up must not cost the other cells
                    print(f"[vllm-kv] repeat {repeat} {route}: FAILED: {exc}", flush=True)
                    data.setdefault("failed_cells", []).append(f"{route} #{repeat}: {str(exc)[:300]}")
                    continue
                row["repeat"] = repeat
                data["rows"].append(row)
                print(f"[vllm-kv] repeat {repeat} {route}: ok={row['ok']} failed={row['failed']} "
                      f"makespan={row['makespan_s']:.1f}s ttft_p99={ms(row['ttft_p99'])} "
                      f"hit={fmt((row['prefix_hit'] or 0) * 100)}% stalls={row['stalls_declared']} "
                      f"({time.time() - t0:.0f} s)", flush=True)
    write_json(results_path(args.name, ".json", args.out_dir), data)
    report = render(data)
    results_path(args.name, ".md", args.out_dir).write_text(report)
    print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_kv", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
