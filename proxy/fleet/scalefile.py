"""`kvroute scale` writes the new replica count back into the config file, keeping everything else.

Owns the text edit only: the `replicas:` value of one model is replaced where the YAML parser says it is
(comments, order, quoting and `${VAR}`s elsewhere stay byte for byte); the fleet manager decides when.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml


class ScaleWriteError(ValueError):
    """The file cannot take the new count (unreadable, not a fleet config, model missing, odd layout)."""


def set_replicas(text: str, model: str, replicas: int) -> str:
    """`text` with models[name == model].replicas set to `replicas` (added after `name:` when absent)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ScaleWriteError(f"not valid YAML: {exc}") from None
    models = _value(root, "models") if isinstance(root, yaml.MappingNode) else None
    if not isinstance(models, yaml.SequenceNode):
        raise ScaleWriteError("no `models:` list")
    for entry in models.value:
        if not isinstance(entry, yaml.MappingNode):
            continue
        name = _value(entry, "name")
        if not isinstance(name, yaml.ScalarNode) or name.value != model:
            continue
        current = _value(entry, "replicas")
        if current is not None:
            if not isinstance(current, yaml.ScalarNode):
                raise ScaleWriteError(f"models[{model}].replicas is not a plain value")
            if "${" in current.value:  # the operator chose where the count comes from: do not overwrite it
                raise ScaleWriteError(f"replicas of {model} comes from {current.value}")
            return text[:current.start_mark.index] + str(replicas) + text[current.end_mark.index:]
        if entry.flow_style:
            raise ScaleWriteError(f"model {model} is written in flow style {{...}}; add `replicas:` to it by hand")
        name_key = next(k for k, _ in entry.value if k.value == "name")
        line_end = text.find("\n", name.end_mark.index)
        line_end = len(text) if line_end < 0 else line_end
        indent = " " * name_key.start_mark.column
        return text[:line_end] + f"\n{indent}replicas: {replicas}" + text[line_end:]
    raise ScaleWriteError(f"no model named {model!r} in the file")


def write_replicas(path: Path, model: str, replicas: int) -> None:
    """Edit `path` in place (write-then-rename, as editors do, so a watcher never reads half a file).
    Blocking file I/O: call through a thread."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScaleWriteError(f"cannot read {path}: {exc.strerror}") from None
    new = set_replicas(text, model, replicas)
    if new == text:
        return
    tmp = path.with_name(f".{path.name}.kvroute-scale")
    try:
        tmp.write_text(new)
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ScaleWriteError(f"cannot write {path}: {exc.strerror}") from None


def _value(mapping: yaml.MappingNode, key: str) -> yaml.Node | None:
    for k, v in mapping.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return v
    return None
