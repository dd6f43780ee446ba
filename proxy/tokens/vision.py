"""How many placeholder tokens an image becomes, as Qwen2-VL/Qwen3-VL's image processor counts them.

Owns the resize rule (each side to a multiple of patch x merge, the area kept inside [min_pixels, max_pixels],
the aspect ratio as close as it can) and where its numbers come from: the model's preprocessor config (or
processor_config.json's image_processor), the vision tower's patch and merge sizes from config.json, and the
engine's --mm-processor-kwargs. It does not read images (media.py) or tokenize text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# transformers' Qwen2VLImageProcessor defaults, for a config that leaves them out
_DEFAULT_MIN_PIXELS, _DEFAULT_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
MAX_ASPECT_RATIO = 200  # the processor refuses images more elongated than this


@dataclass(frozen=True, slots=True)
class VisionRules:
    patch_size: int = 16
    merge_size: int = 2
    min_pixels: int = _DEFAULT_MIN_PIXELS
    max_pixels: int = _DEFAULT_MAX_PIXELS

    def image_tokens(self, width: int, height: int) -> int | None:
        """Placeholder tokens of a width x height image; None where the processor would refuse it."""
        if width <= 0 or height <= 0 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            return None
        resized_h, resized_w = self.resize(height, width)
        return (resized_h // self.patch_size) * (resized_w // self.patch_size) // (self.merge_size ** 2)

    def resize(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the processor's resize. Python's round() on purpose: the processor's rounds
        half to even too."""
        factor = self.patch_size * self.merge_size
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar


def vision_rules(preprocessor: dict[str, Any] | None, processor: dict[str, Any] | None,
                 model_config: dict[str, Any] | None, engine: dict[str, Any] | None) -> VisionRules:
    """The rules from a checkpoint's configs; `engine`: engine.json (the engine's --mm-processor-kwargs)."""
    image = dict(preprocessor or {})
    if not image and isinstance((processor or {}).get("image_processor"), dict):
        image = dict(processor["image_processor"])  # type: ignore[index]
    size = dict(image.get("size") or {}) if isinstance(image.get("size"), dict) else {}
    overrides = (engine or {}).get("mm_processor_kwargs")
    for source in (image, overrides if isinstance(overrides, dict) else {}):
        if isinstance(source.get("size"), dict) and source is not image:
            size.update(source["size"])
        if isinstance(source.get("min_pixels"), int):
            size["shortest_edge"] = source["min_pixels"]
        if isinstance(source.get("max_pixels"), int):
            size["longest_edge"] = source["max_pixels"]
    tower = (model_config or {}).get("vision_config")
    tower = tower if isinstance(tower, dict) else {}
    patch = _int(tower.get("patch_size"), _int(image.get("patch_size"), 16))
    merge = _int(tower.get("spatial_merge_size"), _int(image.get("merge_size"), 2))
    return VisionRules(patch_size=patch, merge_size=merge,
                       min_pixels=_int(size.get("shortest_edge"), _DEFAULT_MIN_PIXELS),
                       max_pixels=_int(size.get("longest_edge"), _DEFAULT_MAX_PIXELS))


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
