"""README.md's Configuration section names every key config.yaml accepts.

The keys come from the pydantic models the loader validates with (proxy/config.py), so a key added there
without a line in the README fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from proxy.config import FleetConfig

REPO = Path(__file__).resolve().parents[2]


def config_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key path, nested models included (`proxy.timeouts.connect_s`, `models[].limits.max_images`)."""
    keys = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        keys.add(path)
        for sub in _models(field.annotation):
            keys |= config_keys(sub, f"{path}{'[]' if _is_list(field.annotation) else ''}.")
    return keys


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models(arg)]


def _is_list(annotation: object) -> bool:
    return getattr(annotation, "__origin__", None) is list or any(_is_list(a) for a in getattr(annotation, "__args__", ()))


def documented_names(readme: str) -> set[str]:
    """The identifiers inside code spans of the README's Configuration section."""
    section = readme.split("\n## Configuration", 1)[1].split("\n## ", 1)[0]
    return {word for span in re.findall(r"`([^`\n]+)`", section) for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}


def test_every_config_key_is_in_the_readme_reference():
    names = documented_names((REPO / "README.md").read_text())
    missing = sorted(k for k in config_keys(FleetConfig) if k.rsplit(".", 1)[-1].removesuffix("[]") not in names)
    assert missing == [], f"README.md's Configuration section does not name {missing}"


def test_the_key_walk_sees_nested_and_listed_models():
    keys = config_keys(FleetConfig)
    assert {"proxy.timeouts.stall_min_s", "proxy.limits.max_headers", "models[].limits.max_images",
            "proxy.api_keys[].tokens_per_min", "state.ray_gpu_resource", "proxy.static_workers[].url"} <= keys
    assert "models[].replicas" in keys and "proxy.port" in keys
