"""`kvroute make-tiny-model DIR`: build a deterministic, randomly initialised Qwen3-VL checkpoint.

Owns the checkpoint recipe (config shapes, locally trained tokenizer, processor, chat template);
it does not serve anything. No model hub is reachable here, so the default fleet serves this:
its answers are noise, but vLLM runs the real Qwen3-VL compute path on it (vision tower,
DeepStack, interleaved mrope, paged KV cache). `--shape qwen3-vl-2b` gives Qwen3-VL-2B's real
dimensions for realistic GPU timings (it needs ~10 GB of RAM to build).

Determinism: the tokenizer is trained single-threaded on a fixed list of this Python's own
stdlib sources, weights come from a seeded torch generator, and everything is written with
sorted keys, so the same seed (and the same Python/torch/transformers versions) gives the
same bytes.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

# Qwen's special tokens, in Qwen2.5/3's order. The first three are the chat markers.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
# Local text the tokenizer learns from: fixed stdlib files, so every machine trains on the same bytes
# for the same Python version.
CORPUS_MODULES = ["os.py", "json/decoder.py", "json/encoder.py", "argparse.py", "textwrap.py",
                  "string.py", "collections/__init__.py", "functools.py", "pathlib.py", "typing.py",
                  "email/message.py", "http/client.py", "logging/__init__.py", "shutil.py"]

# A Qwen-style chat template: iterates over content parts (so vLLM passes image parts through)
# and emits one <|vision_start|><|image_pad|><|vision_end|> per image, as Qwen3-VL's own does.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'video' or 'video' in content -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}{{- content['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SHAPES: dict[str, dict[str, Any]] = {
    # ~3.3 M parameters: starts in seconds and runs >1000 tokens/s on 2 CPU cores.
    "tiny": {
        "tokenizer_vocab": 4000, "vocab_size": 4096, "tie_word_embeddings": False,
        "text": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                 "max_position_embeddings": 8192, "mrope_section": [12, 10, 10]},
        "vision": {"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4,
                   "out_hidden_size": 128, "deepstack_visual_indexes": [0, 1]},
        "pixels": (64 * 64, 512 * 512),
    },
    # Qwen3-VL-2B-Instruct's dimensions (text 28 x 2048, vision 24 x 1024, vocab 151936, tied).
    "qwen3-vl-2b": {
        "tokenizer_vocab": 8000, "vocab_size": 151936, "tie_word_embeddings": True,
        "text": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 262144, "mrope_section": [24, 20, 20]},
        "vision": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                   "out_hidden_size": 2048, "deepstack_visual_indexes": [5, 11, 17]},
        "pixels": (64 * 64, 1280 * 28 * 28),
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="output folder (created; existing files are overwritten)")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="model dimensions (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(stdlib / name) for name in CORPUS_MODULES if (stdlib / name).exists()]


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on local text, wrapped as a transformers fast tokenizer."""
    # The BPE trainer is parallel; one thread keeps merges (and so the bytes) identical run to run.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=32768, clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
    )


def build_config(shape: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(shape["text"])
    mrope_section = text.pop("mrope_section")
    return Qwen3VLConfig(
        text_config={
            **text, "vocab_size": shape["vocab_size"], "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                "mrope_section": mrope_section, "mrope_interleaved": True},
            "tie_word_embeddings": shape["tie_word_embeddings"], "dtype": "bfloat16",
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={**shape["vision"], "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "in_channels": 3, "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 2304},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=shape["tie_word_embeddings"], dtype="bfloat16",
    )


def build_processor(tokenizer: Any, pixels: tuple[int, int]) -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    min_pixels, max_pixels = pixels
    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels * 4},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor, chat_template=CHAT_TEMPLATE)


def build(out_dir: Path, shape_name: str = "tiny", seed: int = 0) -> Path:
    """Write the checkpoint into `out_dir`; returns it."""
    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    shape = SHAPES[shape_name]
    tokenizer = build_tokenizer(shape["tokenizer_vocab"])
    config = build_config(shape, tokenizer)
    torch.manual_seed(seed)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # init in bf16: the 2B shape would need 2x the RAM in fp32
    try:
        model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.text_config.bos_token_id, eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id, do_sample=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    build_processor(tokenizer, shape["pixels"]).save_pretrained(out_dir)
    return out_dir


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = build(args.dir, args.shape, args.seed)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"built {args.shape} Qwen3-VL (seed {args.seed}) in {out}: {size / 1e6:.1f} MB, "
          f"{time.monotonic() - started:.1f} s")
    return 0
