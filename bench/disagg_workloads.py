"""The disaggregation benchmark's workload families (issue 32): long prompts, a mix with images, multi-turn chats.

Owns generating them from a seed in bench/workloads.py's Workload format (the same `specs()`, shared system prompts
and images); sending them is loadgen's, the matrix bench/disagg.py's. Every request streams with ignore_eos, so its
output length is exact and its inter-token latency measurable. Arrival times are at a mean rate of 1 request per
(simulated) second; the benchmark scales them. Generated files go under bench/.runs/workloads/ (not committed: the
seed makes them again byte for byte).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from bench.loadgen import poisson_arrivals
from bench.workloads import MODEL_A, Workload, _body, _sessions, _words

RUNS_DIR = Path(__file__).resolve().parent / ".runs" / "workloads"
FAMILIES: dict[str, str] = {
    "long_prompt": "unique prompts of 3,000-12,000 tokens (log-uniform), 64-192 tokens out: prefill-heavy",
    "mixed_images": "half short chats (200-800 tokens, 128-256 out) behind 4 shared 400-token system prompts, a "
                    "quarter long documents (4,000-10,000 tokens, 32-128 out), a quarter 1-2 images "
                    "(768-2,304 tokens each, 16 distinct) with a question (64-192 out)",
    "multi_turn": "chats of 4-10 turns behind 8 shared 1,000-2,000-token system prompts; each turn repeats the "
                  "growing history and waits 1-4 s after the previous answer (96-192 out)",
}
KINDS = tuple(FAMILIES)


def _long_prompt(rng: random.Random, n: int) -> list[tuple[float, dict[str, Any], str, int | None, float]]:
    items = []
    for t in poisson_arrivals(1.0, n, rng.randrange(1 << 30)):
        length = int(math.exp(rng.uniform(math.log(3000), math.log(12000))))
        body = _body(MODEL_A, [{"role": "user", "content": _words(rng, length)}], rng.randint(64, 192))
        items.append((t, body, f"len{length}", None, 0.0))
    return items


def _mixed(rng: random.Random, n: int, w: Workload) -> list[tuple[float, dict[str, Any], str, int | None, float]]:
    w.system_prompts = [_words(rng, 400) for _ in range(4)]
    sizes = ((1024, 768), (1024, 1024), (1536, 1024), (1536, 1536))
    w.images = [{"w": sizes[k % 4][0], "h": sizes[k % 4][1], "rgb": [rng.randrange(256) for _ in range(3)]}
                for k in range(16)]
    items = []
    for t in poisson_arrivals(1.0, n, rng.randrange(1 << 30)):
        roll = rng.random()
        if roll < 0.5:
            msgs = [{"role": "system", "content": {"$system": rng.randrange(4)}},
                    {"role": "user", "content": _words(rng, rng.randint(200, 800))}]
            items.append((t, _body(MODEL_A, msgs, rng.randint(128, 256)), "chat", None, 0.0))
        elif roll < 0.75:
            msgs = [{"role": "user", "content": _words(rng, int(math.exp(rng.uniform(math.log(4000),
                                                                                    math.log(10000)))))}]
            items.append((t, _body(MODEL_A, msgs, rng.randint(32, 128)), "document", None, 0.0))
        else:
            parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": {"$image": rng.randrange(16)}}}
                                           for _ in range(rng.choice((1, 1, 2)))]
            parts.append({"type": "text", "text": _words(rng, rng.randint(50, 200))})
            msgs = [{"role": "system", "content": {"$system": rng.randrange(4)}}, {"role": "user", "content": parts}]
            items.append((t, _body(MODEL_A, msgs, rng.randint(64, 192)), "image", None, 0.0))
    return items


def generate(kind: str, seed: int, n: int) -> Workload:
    if kind not in FAMILIES:
        raise ValueError(f"unknown disaggregation workload {kind!r}; known: {', '.join(KINDS)}")
    rng = random.Random(f"disagg-{kind}-{seed}")
    w = Workload(kind, seed, [MODEL_A], kv_tokens=0, note=FAMILIES[kind])  # kv_tokens 0: the preset's own cache
    if kind == "long_prompt":
        items = _long_prompt(rng, n)
    elif kind == "mixed_images":
        items = _mixed(rng, n, w)
    else:
        w.system_prompts = [_words(rng, rng.randint(1000, 2000)) for _ in range(8)]
        items = _sessions(rng, MODEL_A, n, list(range(8)), [1.0] * 8, "turn", (4, 10), (50, 200), (96, 192),
                          (96, 192), (1.0, 4.0))
    order = sorted(range(len(items)), key=lambda i: (items[i][0], i))
    pos = {old: new for new, old in enumerate(order)}
    for old in order:
        t, body, tag, after, gap = items[old]
        record: dict[str, Any] = {"t": round(t, 4), "tag": tag, "body": body}
        if after is not None:
            record["after"], record["gap"] = pos[after], round(gap, 3)
        w.requests.append(record)
    return w


def load_or_generate(kind: str, seed: int, n: int, directory: Path = RUNS_DIR) -> Workload:
    path = directory / f"disagg-{kind}-seed{seed}-n{n}.jsonl.gz"
    if path.exists():
        return Workload.load(path)
    w = generate(kind, seed, n)
    w.save(path)
    return w
