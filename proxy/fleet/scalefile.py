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


def set_replicas(text: str, model: str, replicas: int, role: str | None = None) -> str:
    """`text` with models[name == model].replicas set to `replicas` (added after `name:` when absent); with a
    `role` other than both, that pool's `replicas` in models[name == model].pools."""
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
        if role not in (None, "both") or _value(entry, "pools") is not None:
            return _set_pool_replicas(text, entry, model, replicas, role)
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


def _set_pool_replicas(text: str, entry: yaml.MappingNode, model: str, replicas: int, role: str | None) -> str:
    if role is None:
        raise ScaleWriteError(f"model {model} has pools: give the role of the one to scale")
    pools = _value(entry, "pools")
    if not isinstance(pools, yaml.SequenceNode):
        raise ScaleWriteError(f"model {model} has no `pools:` list")
    for pool in pools.value:
        kind = _value(pool, "role") if isinstance(pool, yaml.MappingNode) else None
        if not isinstance(kind, yaml.ScalarNode) or kind.value != role:
            continue
        assert isinstance(pool, yaml.MappingNode)
        current = _value(pool, "replicas")
        if current is not None:
            if not isinstance(current, yaml.ScalarNode) or "${" in current.value:
                raise ScaleWriteError(f"replicas of the {role} pool of {model} is not a plain value")
            return text[:current.start_mark.index] + str(replicas) + text[current.end_mark.index:]
        if pool.flow_style:  # {role: decode} -> {role: decode, replicas: N}
            close = text.rindex("}", 0, pool.end_mark.index)
            return text[:close].rstrip() + f", replicas: {replicas}" + text[close:]
        line_end = text.find("\n", kind.end_mark.index)
        line_end = len(text) if line_end < 0 else line_end
        role_key = next(k for k, _ in pool.value if k.value == "role")
        return text[:line_end] + f"\n{' ' * role_key.start_mark.column}replicas: {replicas}" + text[line_end:]
    raise ScaleWriteError(f"model {model} has no pool of role {role}")


def write_replicas(path: Path, model: str, replicas: int, role: str | None = None) -> None:
    """Edit `path` in place (write-then-rename, as editors do, so a watcher never reads half a file).
    Blocking file I/O: call through a thread."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScaleWriteError(f"cannot read {path}: {exc.strerror}") from None
    new = set_replicas(text, model, replicas, role)
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
