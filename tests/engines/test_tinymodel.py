"""`kvroute make-tiny-model`: same seed, same bytes; a Qwen-style chat template with image placeholders."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.support.procs import KVROUTE


def file_hashes(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


# The model `make setup` builds (seed 0) for the default fleet: one build fewer per test that compares with it.
SETUP_MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen3-vl"


def setup_model() -> Path:
    assert (SETUP_MODEL / "config.json").exists(), f"{SETUP_MODEL} is missing: run `make test` (it builds it)"
    return SETUP_MODEL


def build(procs, out: Path, *extra: str) -> Path:
    proc = procs.start([*KVROUTE, "make-tiny-model", str(out), *extra], name="make-tiny-model")
    assert proc.popen.wait(120) == 0, proc.log()
    return out


@pytest.mark.timeout(240)
def test_same_seed_gives_identical_files_and_another_seed_other_weights(procs, tmp_path):
    a = file_hashes(setup_model())  # built by `make setup` with the default seed, 0
    b = file_hashes(build(procs, tmp_path / "b"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(a)
    assert a == b, f"{SETUP_MODEL} differs from a fresh build: built by an older builder? `rm -rf {SETUP_MODEL}`"
    c = file_hashes(build(procs, tmp_path / "c", "--seed", "1"))
    assert c["model.safetensors"] != a["model.safetensors"] and c["tokenizer.json"] == a["tokenizer.json"]


@pytest.mark.timeout(120)
def test_chat_template_puts_one_vision_block_per_image(procs, tmp_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(setup_model())
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                             {"type": "text", "text": "what differs?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = processor.tokenizer("<|im_start|><|image_pad|>")["input_ids"]
    assert len(ids) == 2  # special tokens are single tokens, as vLLM's placeholder matching needs
