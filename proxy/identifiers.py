"""The grammar of identifiers that reach HTTP headers, URL paths, metric labels and log lines.

Owns what a worker id, a model name, a label, a worker URL may contain, and how
long each may be; and escaping caller text for a log line (the bytes of a header the data plane writes
are proxy/dataplane/http.py's safe_value). A leaf module (imports nothing of the
proxy), so proxy/protocol.py, which workers import too, validates with it. Not where each check runs.
"""

from __future__ import annotations

import re

MAX_WORKER_ID_CHARS = 128
MAX_MODEL_NAME_CHARS = 256      # a checkpoint path as vLLM's default served name, within reason
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_LABELS = 32
MAX_MODELS_PER_WORKER = 64
MAX_URL_CHARS = 2048
MAX_TOKEN_CHARS = 1024          # an engine API key the proxy sends upstream in a header

# Letters, digits and a few separators; the first a letter or digit. No "/" (ids are one URL path
# segment: /workers/{id}/report), no space, nothing a header, a log line or a shell would read specially.
_WORKER_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:@~+-]{{0,{MAX_WORKER_ID_CHARS - 1}}}")
# Model names as engines serve them: "Qwen/Qwen3-VL-8B-Instruct", "qwen3-vl:8b", "/models/tiny-qwen3-vl".
_MODEL_NAME = re.compile(rf"[A-Za-z0-9_./][A-Za-z0-9._:/@~+=-]{{0,{MAX_MODEL_NAME_CHARS - 1}}}")
_LABEL_KEY = re.compile(rf"[A-Za-z_][A-Za-z0-9_.-]{{0,{MAX_LABEL_KEY_CHARS - 1}}}")
# Visible ASCII only: no space, no control character (CR, LF, NUL, ESC), nothing outside ASCII.
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_WORKER_ID_CHARS = "letters, digits and . _ : @ ~ + -, starting with a letter or digit"
_MODEL_CHARS = "letters, digits and . _ : / @ ~ + = -"


class UnsafeIdentifier(ValueError):
    """A value that may not go into a header, a path, a label or a log line; the message names why."""


def _why_not(value: object, what: str, limit: int, allowed: str) -> str:
    if not isinstance(value, str):
        return f"{what} must be a string"
    if not value:
        return f"{what} must not be empty"
    if len(value) > limit:
        return f"{what} is {len(value)} characters long; at most {limit} are allowed"
    if _CONTROL.search(value):
        return f"{what} contains a control character (CR, LF, NUL, ...); only {allowed} are allowed"
    return f"{what} may contain only {allowed}"


def worker_id(value: str) -> str:
    """`value` if it is a valid worker id, else UnsafeIdentifier (one URL path segment, one header value)."""
    if isinstance(value, str) and _WORKER_ID.fullmatch(value):
        return value
    raise UnsafeIdentifier(_why_not(value, "a worker id", MAX_WORKER_ID_CHARS, _WORKER_ID_CHARS))


def model_name(value: str) -> str:
    """`value` if it is a valid served model name (or alias), else UnsafeIdentifier."""
    if isinstance(value, str) and _MODEL_NAME.fullmatch(value):
        return value
    raise UnsafeIdentifier(_why_not(value, "a model name", MAX_MODEL_NAME_CHARS, _MODEL_CHARS))


def is_model_name(value: str) -> bool:
    return _MODEL_NAME.fullmatch(value) is not None


def labels(values: dict[str, str]) -> dict[str, str]:
    """Worker labels: at most MAX_LABELS, keys like identifiers, values printable text of bounded length."""
    if len(values) > MAX_LABELS:
        raise UnsafeIdentifier(f"at most {MAX_LABELS} labels are allowed, got {len(values)}")
    for key, value in values.items():
        if not _LABEL_KEY.fullmatch(key):
            raise UnsafeIdentifier(_why_not(key, "a label key", MAX_LABEL_KEY_CHARS,
                                            "letters, digits and _ . -, starting with a letter or _"))
        if len(value) > MAX_LABEL_VALUE_CHARS or not value.isprintable():
            raise UnsafeIdentifier(f"label {key!r}: " + _why_not(value, "its value", MAX_LABEL_VALUE_CHARS,
                                                                  "printable characters"))
    return values


def visible_token(value: str, what: str = "a token", limit: int = MAX_TOKEN_CHARS) -> str:
    """`value` if it is 1..limit visible ASCII characters (a key, a boot id), else UnsafeIdentifier."""
    if isinstance(value, str) and len(value) <= limit and _VISIBLE_ASCII.fullmatch(value):
        return value
    raise UnsafeIdentifier(_why_not(value, what, limit, "visible ASCII characters (no space)"))


def worker_url(value: str) -> str:
    """A worker URL's characters: visible ASCII, at most MAX_URL_CHARS (its shape is checked elsewhere)."""
    return visible_token(value, "the url", MAX_URL_CHARS)


def for_log(value: object, limit: int = 200) -> str:
    """Caller-supplied text for one log line: control characters escaped (no forged lines, no terminal
    escapes), cut to `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > limit
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text[:limit])
    return text + ("..." if cut else "")
