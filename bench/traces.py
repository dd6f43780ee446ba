"""Mooncake-format request traces as routing-quality families: read a window, render it as requests.

Owns the trace format, the window, the rendering of hash ids as token-exact text and the family's shape for
bench/quality.py; it sends nothing (loadgen.py) and does not calibrate loads (quality.py).

Format (Mooncake FAST'25 release): one JSON object per line, {"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [...]}, where hash id k names the prompt's k-th block of 512 tokens and
equal ids mean equal blocks (a reusable prefix). Each request becomes a streamed /v1/completions request: its
prompt is the blocks' texts in order, the last block cut to input_length (so a block shared in full or in part
stays shared), and it generates exactly output_length tokens (max_tokens, ignore_eos, min_tokens).

A block's text is 512 words drawn (seeded by the hash id and the cell's salt) from a vocabulary of words that
are one token each, with their leading space, both by the sim's rule (backends/sim/tokens.py) and, when
given, by a real tokenizer (tokenizer.json of the served model): words split only at spaces, so a prompt has
exactly input_length tokens and its 512-token blocks start where the trace's do.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import RequestSpec

BLOCK_TOKENS = 512
TRACE_DIR = Path(__file__).resolve().parent / ".traces"
TRACE_URL = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
# family -> (file under TRACE_DIR, one line)
TRACE_FAMILIES: dict[str, tuple[str, str]] = {
    "trace_conversation": ("conversation_trace.jsonl", "Mooncake FAST'25 conversation trace (chat service, "
                                                       "arrival times as recorded)"),
    "trace_synthetic": ("synthetic_trace.jsonl", "Mooncake FAST'25 synthetic trace (public datasets, Poisson "
                                                 "arrivals, multi-turn order kept)"),
    "trace_toolagent": ("toolagent_trace.jsonl", "Mooncake FAST'25 tool-and-agent trace (arrival times as "
                                                 "recorded)"),
}
DEFAULT_DURATION_S = 300.0
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
_WORD = re.compile(r"[a-z]{2,5}")  # with its leading space at most 6 characters: one sim token


@dataclass(frozen=True)
class TraceRequest:
    t_s: float  # arrival, seconds from the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path) -> list[TraceRequest]:
    """Every request of a trace file, in arrival order; ValueError names the line that is wrong."""
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = TraceRequest(row["timestamp"] / 1000.0, int(row["input_length"]), int(row["output_length"]),
                                   tuple(int(h) for h in row["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({exc})") from None
            if req.input_length < 1 or len(req.hash_ids) != math.ceil(req.input_length / BLOCK_TOKENS):
                raise ValueError(f"{path}:{n}: {len(req.hash_ids)} hash ids for {req.input_length} input tokens "
                                 f"(blocks of {BLOCK_TOKENS})")
            out.append(req)
    return sorted(out, key=lambda r: r.t_s)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class BlockVocabulary:
    """Words that are one token each, with a leading space, for the sim and (if given) a real tokenizer."""

    def __init__(self, tokenizer_path: Path | None = None) -> None:
        self.tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        if self.tokenizer is None:
            self.words = [a + b + c + d for a in _CONSONANTS for b in _VOWELS for c in _CONSONANTS for d in _VOWELS]
        else:
            self.words = _single_token_words(self.tokenizer)
        if len(self.words) < 64:
            raise ValueError(f"only {len(self.words)} one-token words in {tokenizer_path}: too few for the blocks")

    def block(self, hash_id: int, salt: str) -> list[str]:
        """The block's BLOCK_TOKENS words, each with its leading space."""
        rng = random.Random(f"{salt}/{hash_id}")
        return [" " + w for w in rng.choices(self.words, k=BLOCK_TOKENS)]


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def _single_token_words(tokenizer: Any) -> list[str]:
    """Lower-case words of 2-5 letters that the tokenizer encodes, with a leading space, as one token."""
    found = []
    for token in sorted(tokenizer.get_vocab()):
        word = tokenizer.decode([tokenizer.token_to_id(token)]).removeprefix(" ")
        if _WORD.fullmatch(word) and len(tokenizer.encode(" " + word, add_special_tokens=False).ids) == 1:
            found.append(word)
    return sorted(set(found))


def render_prompt(req: TraceRequest, vocab: BlockVocabulary, salt: str, cache: dict[int, list[str]]) -> str:
    """The request's prompt: its blocks in order, the last one cut so the prompt has input_length tokens."""
    words: list[str] = []
    for h in req.hash_ids:
        block = cache.get(h)
        if block is None:
            block = cache[h] = vocab.block(h, salt)
        words.extend(block[:req.input_length - len(words)])
    return "".join(words)


@dataclass
class TraceWorkload:
    """A window of a trace, shaped like workloads.Workload for bench/quality.py. Arrival times are stored at a
    mean of 1 request/s (t_norm = seconds into the window x the window's own rate), as the generated families'
    are, so `specs(rate)` offers `rate` requests/s; the trace's own rate is `native_rate`."""

    kind: str
    path: Path
    sha256: str
    start_s: float
    duration_s: float
    requests: list[TraceRequest]
    skipped_over_context: int  # window requests longer than the engines' context (they would be refused)
    kv_tokens: int
    model: str
    vocab: BlockVocabulary = field(repr=False, default_factory=BlockVocabulary)
    note: str = ""
    _shared: Counter[int] | None = field(default=None, init=False, repr=False)

    @property
    def native_rate(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s > 0 else 1.0

    def meta(self) -> dict[str, Any]:
        """What the result rows carry to name the trace and the window."""
        return {"trace": self.path.name, "trace_sha256": self.sha256, "trace_start_s": self.start_s,
                "trace_duration_s": self.duration_s, "trace_requests": len(self.requests),
                "trace_rate": self.native_rate, "trace_skipped_over_context": self.skipped_over_context}

    def worker_models_for(self, workers: int) -> list[str]:
        return [self.model] * workers

    def specs(self, rate_per_s: float, salt: str = "", limit: int | None = None) -> list[RequestSpec]:
        cache: dict[int, list[str]] = {}
        out = []
        for r in self.requests[:limit]:
            t_norm = (r.t_s - self.start_s) * self.native_rate
            out_tokens = max(1, r.output_length)
            body = {"model": self.model, "prompt": render_prompt(r, self.vocab, salt, cache),
                    "max_tokens": out_tokens, "min_tokens": out_tokens, "ignore_eos": True, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
            out.append(RequestSpec(body, path="/v1/completions", arrival_s=t_norm / rate_per_s,
                                   tag=f"h{r.hash_ids[0]}"))
        return out

    def warm_up_specs(self, salt: str = "", limit: int | None = None) -> list[RequestSpec]:
        """None: a trace's window starts with the caches its own requests fill."""
        return []

    def _block_uses(self) -> Counter[int]:
        """How many requests of the window present each block."""
        if self._shared is None:
            self._shared = Counter(h for r in self.requests for h in set(r.hash_ids))
        return self._shared

    def shared_prefix_key(self, i: int) -> int | None:
        """Request i's first block when another request of the window shares it (for bench/tails.py)."""
        first = self.requests[i].hash_ids[0]
        return first if self._block_uses()[first] > 1 else None

    def shared_prefix_tokens(self) -> int:
        """Tokens of the blocks two or more requests of the window share (the reusable prefixes)."""
        return BLOCK_TOKENS * sum(1 for k in self._block_uses().values() if k > 1)


def trace_path(family: str, trace_dir: Path = TRACE_DIR) -> Path:
    return trace_dir / TRACE_FAMILIES[family][0]


def family_for_path(path: Path) -> str:
    """The family name a `--trace FILE` runs under: trace_ + the file's stem without `_trace`."""
    return "trace_" + re.sub(r"[^a-z0-9_]+", "_", path.name.split(".")[0].lower()).removesuffix("_trace")


def load_window(family: str, path: Path, start_s: float, duration_s: float | None, max_context: int,
                kv_tokens: int, model: str, vocab: BlockVocabulary) -> TraceWorkload:
    """The requests arriving in [start_s, start_s + duration_s) (to the end when duration_s is None), less those
    whose prompt and output do not fit `max_context` tokens."""
    if not path.exists():
        name = TRACE_FAMILIES.get(family, (path.name,))[0]
        raise FileNotFoundError(f"trace file {path} is missing; get it with: mkdir -p {path.parent} && "
                                f"curl -L -o {path} {TRACE_URL}{name}")
    every = read_trace(path)
    end = start_s + duration_s if duration_s is not None else math.inf
    window = [r for r in every if start_s <= r.t_s < end]
    kept = [r for r in window if r.input_length + max(1, r.output_length) <= max_context]
    if not kept:
        raise ValueError(f"no request of {path.name} arrives in [{start_s}, {end}) s and fits {max_context} tokens")
    duration = duration_s if duration_s is not None else max(r.t_s for r in window) - start_s
    note = TRACE_FAMILIES[family][1] if family in TRACE_FAMILIES else f"trace {path.name}"
    return TraceWorkload(family, path, file_sha256(path), start_s, duration, kept, len(window) - len(kept),
                         kv_tokens, model, vocab, note)


def synthetic_trace(seed: int, requests: int, rate_per_s: float = 2.0, conversations: int = 16,
                    system_blocks: int = 1) -> list[dict[str, Any]]:
    """A small trace in the Mooncake format, for tests: multi-turn conversations behind a few shared system
    prompts, each turn's prompt its conversation's previous prompt plus new blocks, Poisson arrivals."""
    rng = random.Random(seed)
    next_id = 0

    def new_blocks(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [new_blocks(system_blocks) for _ in range(3)]
    history: dict[int, list[int]] = {}  # a conversation's full blocks so far
    t, rows = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        c = rng.randrange(conversations)
        blocks = (history.get(c) or list(rng.choice(systems))) + new_blocks(rng.randint(1, 2))
        history[c] = blocks[:-1]  # this turn's last block is partial: the next turn's differs from there
        tail = rng.randint(1, BLOCK_TOKENS)
        rows.append({"timestamp": int(t * 1000), "input_length": (len(blocks) - 1) * BLOCK_TOKENS + tail,
                     "output_length": rng.randint(4, 32), "hash_ids": blocks})
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.traces", description="write a small synthetic trace in the "
                                "Mooncake format (bench/data/tiny_trace.jsonl is seed 7, 80 requests)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rows = synthetic_trace(args.seed, args.requests, args.rate)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{args.out}: {len(rows)} requests over {rows[-1]['timestamp'] / 1000:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
