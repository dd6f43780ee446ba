"""Routing-quality workloads: generated from a seed, saved compactly under bench/workloads/, loaded back.

Owns the four workload shapes (chat, vqa, bursty, mix) and their file format; sending them is
loadgen's job. Arrival times are stored for a mean rate of 1 request/s and scaled at load time.

File format (gzipped JSON lines): a header {"kind", "seed", "models", "system_prompts", "images"} and then
one request per line {"t", "tag", "body"} where a message content may be {"$system": k} (the k-th
shared system prompt) and an image URL may be {"$image": k}; images are regenerated from their
(width, height, colour) entry as PNG data: URLs, so the files stay small.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import RequestSpec, bursty_arrivals, poisson_arrivals

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
KINDS = ("chat", "vqa", "bursty", "mix")
MODEL_A, MODEL_B = "qwen3-vl-8b", "qwen3-vl-8b-b"
# Image sizes (px): Qwen3-VL gives one token per 32x32 px, so 64 .. 1875 tokens each.
IMAGE_SIZES = ((256, 256), (512, 512), (768, 768), (1024, 768), (1280, 960), (1600, 1200))

_SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "sa", "vo", "ne", "di", "pa", "shi", "ro", "qu", "el", "an")


def _words(rng: random.Random, n: int) -> str:
    # words of 2..5 letters: one token each under the sim's rule (and close to BPE for such words)
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 2))) for _ in range(n))


@dataclass
class Workload:
    kind: str
    seed: int
    models: list[str]
    system_prompts: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)  # {"w", "h", "rgb"}
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"t", "tag", "body"}

    # ---- files ------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            f.write(json.dumps({"kind": self.kind, "seed": self.seed, "models": self.models,
                                "system_prompts": self.system_prompts, "images": self.images}) + "\n")
            for r in self.requests:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: Path) -> Workload:
        with gzip.open(path, "rt") as f:
            head = json.loads(f.readline())
            reqs = [json.loads(line) for line in f if line.strip()]
        return cls(head["kind"], head["seed"], head["models"], head["system_prompts"], head["images"], reqs)

    # ---- turning it into requests -----------------------------------------------------------
    def specs(self, rate_per_s: float, salt: str = "", limit: int | None = None) -> list[RequestSpec]:
        """RequestSpecs at `rate_per_s` mean offered load. `salt` makes every shared prefix and image
        new (so each benchmark cell starts with cold caches on warm workers)."""
        image_urls: dict[int, str] = {}
        out: list[RequestSpec] = []
        for r in self.requests[:limit]:
            body = json.loads(json.dumps(r["body"]))
            for msg in body["messages"]:
                msg["content"] = self._resolve(msg["content"], salt, image_urls)
            out.append(RequestSpec(body, arrival_s=r["t"] / rate_per_s, tag=r["tag"]))
        return out

    def _resolve(self, content: Any, salt: str, image_urls: dict[int, str]) -> Any:
        if isinstance(content, dict) and "$system" in content:
            return f"[{salt}] " + self.system_prompts[content["$system"]]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "image_url" and isinstance(part["image_url"].get("url"), dict):
                    k = part["image_url"]["url"]["$image"]
                    if k not in image_urls:
                        image_urls[k] = png_data_url(**self.images[k], salt=salt)
                    part = {"type": "image_url", "image_url": {"url": image_urls[k]}}
                parts.append(part)
            return parts
        return content


def png_data_url(w: int, h: int, rgb: list[int], salt: str = "") -> str:
    """A small PNG (one colour, compresses to a few hundred bytes) of the given size; salt goes in a tEXt chunk."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("salt", salt)
    buf = io.BytesIO()
    Image.new("RGB", (w, h), tuple(rgb)).save(buf, format="PNG", pnginfo=info)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat_body(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}


def _sessions(rng: random.Random, model: str, n: int, systems: list[int], weights: list[float],
              tag: str, reply_tokens: tuple[int, int]) -> list[tuple[float, dict[str, Any], str]]:
    """Multi-turn chats: each turn repeats the history (shared system prompt + earlier turns)."""
    out: list[tuple[float, dict[str, Any], str]] = []
    t_session = 0.0
    sid = 0
    while len(out) < n:
        sid += 1
        turns = rng.randint(2, 5)
        t_session += rng.expovariate(1.0 / turns)  # unit mean request rate overall
        system = rng.choices(systems, weights)[0]
        history: list[dict[str, Any]] = [{"role": "system", "content": {"$system": system}}]
        t = t_session
        for _ in range(turns):
            history.append({"role": "user", "content": _words(rng, rng.randint(30, 120))})
            out.append((t, _chat_body(model, list(history), rng.randint(*reply_tokens)), f"{tag}/s{sid}"))
            history.append({"role": "assistant", "content": _words(rng, rng.randint(60, 120))})
            t += rng.uniform(4.0, 12.0)  # think time, in unit-rate seconds
    return out[:n]


def generate(kind: str, seed: int, n: int) -> Workload:
    rng = random.Random(f"{kind}-{seed}")
    if kind == "chat":
        w = Workload(kind, seed, [MODEL_A], [_words(rng, k) for k in (1000, 2000, 3000, 4000)])
        items = _sessions(rng, MODEL_A, n, [0, 1, 2, 3], [4, 3, 2, 1], "chat", (64, 160))
    elif kind == "vqa":
        w = Workload(kind, seed, [MODEL_A], ["You look at images and answer questions about them. " + _words(rng, 40)])
        w.images = [{"w": sz[0], "h": sz[1], "rgb": [rng.randrange(256) for _ in range(3)]}
                    for sz in (IMAGE_SIZES * 4)]
        ts = poisson_arrivals(1.0, n, rng.randrange(1 << 30))
        weights = [1.0 / (k + 1) ** 0.8 for k in range(len(w.images))]  # popular images come back often
        items = []
        for t in ts:
            k = rng.choices(range(len(w.images)), weights)[0]
            content = [{"type": "image_url", "image_url": {"url": {"$image": k}}},
                       {"type": "text", "text": _words(rng, rng.randint(15, 40))}]
            items.append((t, _chat_body(MODEL_A, [{"role": "system", "content": {"$system": 0}},
                                                  {"role": "user", "content": content}], rng.randint(24, 64)), "vqa"))
    elif kind == "bursty":
        w = Workload(kind, seed, [MODEL_A], [_words(rng, 300)])
        ts = bursty_arrivals(1.0, n, rng.randrange(1 << 30), burst_factor=4.0, period_s=20.0, duty=0.2)
        items = [(t, _chat_body(MODEL_A, [{"role": "system", "content": {"$system": 0}},
                                          {"role": "user", "content": _words(rng, rng.randint(200, 1000))}],
                                rng.randint(128, 384)), "bursty") for t in ts]
    elif kind == "mix":
        w = Workload(kind, seed, [MODEL_A, MODEL_B], [_words(rng, k) for k in (1500, 3000, 600)])
        a = _sessions(rng, MODEL_A, int(n * 0.7), [0, 1], [2, 1], "mix-a", (64, 160))
        b = _sessions(rng, MODEL_B, n - len(a), [2], [1], "mix-b", (32, 96))
        # both were generated at unit rate: stretch each to its share of the mix
        items = [(t / 0.7, body, tag) for t, body, tag in a] + [(t / 0.3, body, tag) for t, body, tag in b]
    else:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(KINDS)}")
    items.sort(key=lambda x: x[0])
    w.requests = [{"t": round(t, 4), "tag": tag, "body": body} for t, body, tag in items]
    return w


def load_or_generate(kind: str, seed: int, n: int, directory: Path = WORKLOAD_DIR) -> Workload:
    """The saved workload for (kind, seed, n), generating and saving it on first use."""
    path = directory / f"{kind}-seed{seed}-n{n}.jsonl.gz"
    if path.exists():
        return Workload.load(path)
    w = generate(kind, seed, n)
    w.save(path)
    return w
