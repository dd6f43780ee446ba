"""One place that hides secrets before text reaches a log or an API answer: argv, free text, mappings.

A leaf module (imports nothing of the proxy), so backends/ may use it too, like proxy/protocol.py.
It decides what looks secret; callers decide where redaction is needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

MASK = "***"
# A flag or key whose value is a credential: --api-key, --api-keys, --hf-token, admin_token, SECRET...
# ("kv_capacity_tokens", "max_tokens" are counts: a name must end in "token", singular.)
_SECRET_NAME = re.compile(r"(api[-_]?keys?|secret|passw(or)?d|credential|authorization|cookie)|(^|[-_.])?token$",
                          re.IGNORECASE)
_BEARER = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s:]*(:[^/@\s]*)?@", re.IGNORECASE)
_KEY_VALUE = re.compile(r"\b([A-Za-z][A-Za-z0-9_.-]*)(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|\[[^\]]*\]|[^\s,;&()\[\]{}]+)")
# The same in JSON and in Python's repr of a dict, as engines print their arguments at start-up:
# vLLM's `non-default args: {'api_key': ['sk-...'], ...}`
_QUOTED_KEY_VALUE = re.compile(r"([\"'])([A-Za-z][A-Za-z0-9_.-]*)\1(\s*:\s*)(\"[^\"]*\"|'[^']*'|\[[^\]]*\]|[^\s,;&()\[\]{}]+)")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line with every secret-looking flag's value masked: `--api-key K`, `--api-key=K`,
    `--api-keys K1 K2` (every value up to the next flag), and secrets inside URLs."""
    out: list[str] = []
    masking = False
    for arg in argv:
        if arg.startswith("-"):
            name, eq, _ = arg.partition("=")
            masking = is_secret_name(name.lstrip("-")) and not eq
            out.append(f"{name}={MASK}" if eq and is_secret_name(name.lstrip("-")) else redact_text(arg))
        elif masking:
            out.append(MASK)
        else:
            out.append(redact_text(arg))
    return out


def redact_text(text: str) -> str:
    """Free text with bearer/basic credentials, URL passwords and `token=...`-style pairs masked."""
    text = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    text = _QUOTED_KEY_VALUE.sub(
        lambda m: f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(1)}{MASK}{m.group(1)}"
        if is_secret_name(m.group(2)) else m.group(0), text)
    return _KEY_VALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}" if is_secret_name(m.group(1)) else m.group(0),
                          text)


def redact_mapping(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with values under secret-looking keys masked, nested mappings and lists included."""
    return {k: (MASK if isinstance(k, str) and is_secret_name(k) and v not in (None, "") else _redact_value(v))
            for k, v in data.items()}


def _redact_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return redact_mapping(value)
    if isinstance(value, list):
        return [_redact_value(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
