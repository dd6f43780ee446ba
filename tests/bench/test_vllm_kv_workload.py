"""bench/vllm_kv.py's workload: the shared system prompts are as long as it says, in the served model's tokens."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

from bench.traces import BLOCK_TOKENS, BlockVocabulary
from bench.vllm_kv import system_prompt, workload

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen3-vl"


def test_a_system_prompt_longer_than_a_block_has_exactly_its_tokens() -> None:
    vocab = BlockVocabulary(MODEL_DIR)
    for tokens in (BLOCK_TOKENS - 12, 1000, 3 * BLOCK_TOKENS + 1):
        text = system_prompt(vocab, 2, tokens, "salt")
        assert len(vocab.tokenizer.encode(text, add_special_tokens=False).ids) == tokens


def test_prompts_differ_from_each_other_and_from_cell_to_cell() -> None:
    vocab = BlockVocabulary(MODEL_DIR)
    assert system_prompt(vocab, 0, 1000, "a") != system_prompt(vocab, 1, 1000, "a")
    assert system_prompt(vocab, 0, 1000, "a") != system_prompt(vocab, 0, 1000, "b")
    args = Namespace(seed=1, prompts=3, prompt_tokens=1000, zipf=0.6, question_tokens=8, max_tokens=4, requests=20)
    systems = {spec.body["messages"][0]["content"] for spec in workload(args, vocab, "cell")}
    assert len(systems) <= 3 and all(len(s.split()) == 1000 for s in systems)
