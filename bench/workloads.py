"""Routing-quality workload families: generated from a seed, saved under bench/workloads/, loaded back.

Owns the six families of issue 9 (KV pressure, Zipf-hot prefixes, mixed lengths, growing sessions, bursts,
two models), the fleet shape each needs (KV cap per worker, model per worker) and the file format;
sending them is loadgen's job. Arrival times and think times are stored at a mean rate of 1 request/s.

File format (gzipped JSON lines): a header {"kind", "seed", "models", "worker_models", "kv_tokens",
"system_prompts", "images", "note"} and then one request per line {"t", "tag", "body", "after", "gap"}
where a message content may be {"$system": k} (the k-th shared system prompt) and an image URL
{"$image": k}; images are regenerated from their (w, h, rgb) entry as PNG data: URLs (small files).
"after" is the index of the request that must finish first (a session's previous turn), "gap" the
think time after it.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import RequestSpec, bursty_arrivals, poisson_arrivals

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
MODEL_A, MODEL_B = "qwen3-vl-8b", "qwen3-vl-8b-b"
# family name -> (letter in issue 9, one line)
FAMILIES: dict[str, tuple[str, str]] = {
    "kv_pressure": ("a", "16 shared prefixes (long system prompts, system prompt + large image) totalling ~2x one "
                         "worker's KV cache: they fit the fleet, not one worker"),
    "zipf_hot": ("b", "48 shared system prompts (800-2500 tokens) with Zipf(1.2) popularity: a few hot prefixes"),
    "lengths": ("c", "prompt lengths log-uniform 100-8000 tokens in one mix, half behind 8 shared 500-token heads"),
    "sessions": ("d", "multi-turn sessions (3-8 turns) whose history grows; each turn waits for the previous one"),
    "bursts": ("e", "arrivals 5x denser during 15% of every 20 s period (open loop); 4 shared system prompts"),
    "two_models": ("f", "two models behind one endpoint: 3 workers serve A, 1 serves B; 70/30 traffic"),
}
KINDS = tuple(FAMILIES)
DEFAULT_REQUESTS = 1000

_SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "sa", "vo", "ne", "di", "pa", "shi", "ro", "qu", "el", "an")


def _words(rng: random.Random, n: int) -> str:
    # words of 2..5 letters: one token each under the sim's rule (and close to BPE for such words)
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 2))) for _ in range(n))


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


@dataclass
class Workload:
    kind: str
    seed: int
    models: list[str]
    worker_models: list[str] = field(default_factory=lambda: [MODEL_A] * 4)  # model of each sim worker
    kv_tokens: int = 65536  # KV cap per worker this family is sized for
    system_prompts: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)  # {"w", "h", "rgb"}
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"t", "tag", "body", "after", "gap"}
    note: str = ""

    # ---- files ------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            f.write(json.dumps({"kind": self.kind, "seed": self.seed, "models": self.models,
                                "worker_models": self.worker_models, "kv_tokens": self.kv_tokens,
                                "system_prompts": self.system_prompts, "images": self.images,
                                "note": self.note}) + "\n")
            for r in self.requests:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: Path) -> Workload:
        with gzip.open(path, "rt") as f:
            head = json.loads(f.readline())
            reqs = [json.loads(line) for line in f if line.strip()]
        return cls(head["kind"], head["seed"], head["models"], head["worker_models"], head["kv_tokens"],
                   head["system_prompts"], head["images"], reqs, head.get("note", ""))

    def worker_models_for(self, workers: int) -> list[str]:
        """The family's model split scaled to `workers` workers (at least one per model)."""
        if len(set(self.worker_models)) == 1:
            return [self.worker_models[0]] * workers
        b = max(1, round(workers * self.worker_models.count(MODEL_B) / len(self.worker_models)))
        return [MODEL_A] * max(1, workers - b) + [MODEL_B] * b

    # ---- turning it into requests -----------------------------------------------------------
    def specs(self, rate_per_s: float, salt: str = "", limit: int | None = None) -> list[RequestSpec]:
        """RequestSpecs at `rate_per_s` mean offered load. `salt` makes every shared prefix and image
        new (so each cell starts with caches no earlier cell warmed). Dependencies beyond `limit` are dropped."""
        image_urls: dict[int, str] = {}
        out: list[RequestSpec] = []
        for r in self.requests[:limit]:
            body = json.loads(json.dumps(r["body"]))
            for msg in body["messages"]:
                msg["content"] = self._resolve(msg["content"], salt, image_urls)
            out.append(RequestSpec(body, arrival_s=r["t"] / rate_per_s, tag=r["tag"], after=r.get("after"),
                                   gap_s=r.get("gap", 0.0) / rate_per_s))
        return out

    def warm_up_specs(self, salt: str = "", limit: int | None = None) -> list[RequestSpec]:
        """One request per shared prefix of the first `limit` requests, in arrival order: that prefix (system
        prompt, and image), the question "warm up" and one output token. Sent before a cell (`bench quality
        --warm`) they leave every prefix cached somewhere, as in a fleet that has been serving; no measured
        request's own text is among them."""
        out: list[RequestSpec] = []
        seen: set[Any] = set()
        for i, spec in enumerate(self.specs(1.0, salt=salt, limit=limit)):
            key = self.shared_prefix_key(i)
            if key is None or key in seen:
                continue
            seen.add(key)
            system, user = spec.body["messages"][:2]
            content: Any = "warm up"
            if isinstance(user["content"], list):
                content = [p for p in user["content"] if p.get("type") == "image_url"] + \
                    [{"type": "text", "text": "warm up"}]
            out.append(RequestSpec({**spec.body, "max_tokens": 1, "messages": [system, {"role": "user",
                                                                                    "content": content}]},
                                   tag="warm-up"))
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

    def shared_prefix_key(self, i: int) -> tuple[str, int, int | None] | None:
        """Request i's shared prefix: (model, system prompt, image or None), or None when it has none."""
        body = self.requests[i]["body"]
        msgs = body["messages"]
        sys_k = msgs[0]["content"]["$system"] if isinstance(msgs[0]["content"], dict) else None
        if sys_k is None:
            return None
        img = None
        if len(msgs) > 1 and isinstance(msgs[1]["content"], list):
            img = next((p["image_url"]["url"]["$image"] for p in msgs[1]["content"]
                        if p.get("type") == "image_url"), None)
        return body["model"], sys_k, img

    def shared_prefix_tokens(self) -> int:
        """Tokens of every distinct shared prefix (system prompt, or system prompt + image), by the sim's rules."""
        from backends.sim.tokens import count_text_tokens, image_tokens_for_size

        seen: set[tuple[int, int | None]] = set()
        total = 0
        for i in range(len(self.requests)):
            key = self.shared_prefix_key(i)
            if key is None or key[1:] in seen:
                continue
            _, sys_k, img = key
            seen.add((sys_k, img))
            total += count_text_tokens(self.system_prompts[sys_k]) + 8
            if img is not None:
                total += image_tokens_for_size(self.images[img]["w"], self.images[img]["h"])
        return total


def png_data_url(w: int, h: int, rgb: list[int], salt: str = "") -> str:
    """A small PNG (one colour, compresses to a few hundred bytes) of the given size; salt goes in a tEXt chunk."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("salt", salt)
    buf = io.BytesIO()
    Image.new("RGB", (w, h), tuple(rgb)).save(buf, format="PNG", pnginfo=info)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}


Item = tuple[float, dict[str, Any], str, int | None, float]  # (t, body, tag, after (local index), gap)


def _single(rng: random.Random, model: str, ts: list[float], pick_system: Any, user: tuple[int, int],
            out: tuple[int, int], tag: str) -> list[Item]:
    return [(t, _body(model, [{"role": "system", "content": {"$system": pick_system()}},
                              {"role": "user", "content": _words(rng, rng.randint(*user))}], rng.randint(*out)),
             tag, None, 0.0) for t in ts]


def _sessions(rng: random.Random, model: str, n: int, systems: list[int], weights: list[float], tag: str,
              turns: tuple[int, int], user: tuple[int, int], reply: tuple[int, int], out: tuple[int, int],
              think: tuple[float, float]) -> list[Item]:
    """Multi-turn chats: each turn repeats the growing history and waits for the previous turn to finish."""
    items: list[Item] = []
    t_session = 0.0
    sid = 0
    while len(items) < n:
        sid += 1
        k = rng.randint(*turns)
        t_session += rng.expovariate(1.0 / k)  # unit mean request rate overall
        history: list[dict[str, Any]] = [{"role": "system", "content": {"$system": rng.choices(systems, weights)[0]}}]
        prev: int | None = None
        t = t_session
        for _ in range(k):
            history.append({"role": "user", "content": _words(rng, rng.randint(*user))})
            gap = rng.uniform(*think) if prev is not None else 0.0
            items.append((t, _body(model, list(history), rng.randint(*out)), f"{tag}/s{sid}", prev, gap))
            prev = len(items) - 1
            history.append({"role": "assistant", "content": _words(rng, rng.randint(*reply))})
            t += gap
    return items[:n]


def generate(kind: str, seed: int, n: int) -> Workload:
    rng = random.Random(f"{kind}-{seed}")
    if kind not in FAMILIES:
        raise ValueError(f"unknown workload family {kind!r}; known: {', '.join(KINDS)}")
    w = Workload(kind, seed, [MODEL_A], note=FAMILIES[kind][1])
    items: list[Item]
    if kind == "kv_pressure":
        w.kv_tokens = 32768
        # 8 long system prompts (3000-6000 tokens) and 8 (300-token system prompt + 2048x1536 image = 3072 tokens)
        w.system_prompts = [_words(rng, rng.randint(3000, 6000)) for _ in range(8)] + \
            ["You describe images precisely. " + _words(rng, 300) for _ in range(8)]
        w.images = [{"w": 2048, "h": 1536, "rgb": [rng.randrange(256) for _ in range(3)]} for _ in range(8)]
        weights = _zipf_weights(16, 0.6)
        order = list(range(16))
        rng.shuffle(order)  # text and image prefixes interleaved in popularity
        items = []
        for t in poisson_arrivals(1.0, n, rng.randrange(1 << 30)):
            p = order[rng.choices(range(16), weights)[0]]
            question = _words(rng, rng.randint(30, 150))
            if p < 8:
                msgs = [{"role": "system", "content": {"$system": p}}, {"role": "user", "content": question}]
            else:
                msgs = [{"role": "system", "content": {"$system": p}},
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": {"$image": p - 8}}},
                                                     {"type": "text", "text": question}]}]
            items.append((t, _body(MODEL_A, msgs, rng.randint(16, 128)), f"p{p}", None, 0.0))
    elif kind == "zipf_hot":
        w.system_prompts = [_words(rng, rng.randint(800, 2500)) for _ in range(48)]
        weights = _zipf_weights(48, 1.2)
        items = _single(rng, MODEL_A, poisson_arrivals(1.0, n, rng.randrange(1 << 30)),
                        lambda: rng.choices(range(48), weights)[0], (50, 300), (16, 128), "zipf")
    elif kind == "lengths":
        w.system_prompts = [_words(rng, 500) for _ in range(8)]
        items = []
        for t in poisson_arrivals(1.0, n, rng.randrange(1 << 30)):
            length = int(math.exp(rng.uniform(math.log(100), math.log(8000))))
            if rng.random() < 0.5 and length > 600:
                msgs = [{"role": "system", "content": {"$system": rng.randrange(8)}},
                        {"role": "user", "content": _words(rng, length - 510)}]
            else:
                msgs = [{"role": "user", "content": _words(rng, max(1, length - 10))}]
            items.append((t, _body(MODEL_A, msgs, rng.randint(16, 256)), f"len{length}", None, 0.0))
    elif kind == "sessions":
        w.kv_tokens = 49152
        w.system_prompts = [_words(rng, rng.randint(1000, 2000)) for _ in range(8)]
        items = _sessions(rng, MODEL_A, n, list(range(8)), [1.0] * 8, "sess", (3, 8), (50, 200), (80, 200),
                          (16, 128), (1.0, 5.0))
    elif kind == "bursts":
        w.system_prompts = [_words(rng, 1500) for _ in range(4)]
        ts = bursty_arrivals(1.0, n, rng.randrange(1 << 30), burst_factor=5.0, period_s=20.0, duty=0.15)
        items = _single(rng, MODEL_A, ts, lambda: rng.randrange(4), (100, 1500), (32, 256), "burst")
    else:  # two_models
        w.kv_tokens = 49152
        w.models = [MODEL_A, MODEL_B]
        w.worker_models = [MODEL_A, MODEL_A, MODEL_A, MODEL_B]
        w.system_prompts = [_words(rng, k) for k in (1500, 3000, 800, 2000)]
        a = _sessions(rng, MODEL_A, int(n * 0.7), [0, 1, 2], [3, 2, 1], "A", (2, 5), (30, 120), (60, 120),
                      (16, 128), (1.0, 5.0))
        b = _sessions(rng, MODEL_B, n - len(a), [3], [1], "B", (2, 5), (30, 120), (60, 120), (16, 96), (1.0, 5.0))
        # both were generated at unit rate: stretch each to its share of the mix (B's indexes shift past A's)
        items = [(t / 0.7, body, tag, after, gap / 0.7) for t, body, tag, after, gap in a] + \
                [(t / 0.3, body, tag, None if after is None else after + len(a), gap / 0.3)
                 for t, body, tag, after, gap in b]
    # sort by arrival; remap `after` to the new positions (a turn always comes after its predecessor)
    order = sorted(range(len(items)), key=lambda i: (items[i][0], i))
    pos = {old: new for new, old in enumerate(order)}
    w.requests = []
    for old in order:
        t, body, tag, after, gap = items[old]
        rec: dict[str, Any] = {"t": round(t, 4), "tag": tag, "body": body}
        if after is not None:
            rec["after"], rec["gap"] = pos[after], round(gap, 3)
        w.requests.append(rec)
    return w


def load_or_generate(kind: str, seed: int, n: int, directory: Path = WORKLOAD_DIR) -> Workload:
    """The saved workload for (kind, seed, n), generating and saving it on first use."""
    path = directory / f"{kind}-seed{seed}-n{n}.jsonl.gz"
    if path.exists():
        return Workload.load(path)
    w = generate(kind, seed, n)
    w.save(path)
    return w
