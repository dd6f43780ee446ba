"""OpenAI chat messages as the engine's chat template sees them (vLLM 0.32's chat path).

Owns that translation: content parts become `{"type": "text", "text": ...}` and `{"type": "image"}` /
`{"type": "video"}` placeholders (extra fields kept), tool messages' text parts are joined, assistant tool-call
arguments become objects, developer messages become system ones where the template has no developer role,
and `tools` take the shape the engine's request model gives them. Also the media items in prompt order.
It never changes the request: everything it returns is a copy. Rendering is template.py's.

`Unsupported` means vLLM would refuse the message or count it in a way this module does not model (audio,
embeddings, string-format templates with media): the caller then keeps its estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import orjson

OPENAI, STRING = "openai", "string"  # how a template takes message content (vLLM's content formats)

TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
_TEXT_KEY = {"refusal": "refusal", "thinking": "thinking"}  # where the text of these part types is
_IMAGE_PARTS = {"image_url": "image_url", "input_image": "image_url"}
_VIDEO_PARTS = {"video_url": "video_url"}
# Fields vLLM's content-part models know; any other field of a part reaches the template as it came.
_KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
    "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url"})
_BILLING_HEADER = "x-anthropic-billing-header"


class Unsupported(ValueError):
    """A request this module cannot count as the engine would."""


@dataclass(frozen=True, slots=True)
class MediaRef:
    kind: str  # "image" or "video"
    url: str | None  # the data: or http(s) URL, None when the part has none


def conversation(messages: list[Any], content_format: str, template_has_developer: bool) -> tuple[
        list[dict[str, Any]], list[MediaRef]]:
    """(the conversation the template renders, the media in prompt order)."""
    out: list[dict[str, Any]] = []
    media: list[MediaRef] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unsupported("a message without a string role")
        out.append(_message(message, content_format, media))
    for message in out:
        _tool_call_arguments_as_objects(message)
    if not template_has_developer and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out, media


def _message(message: dict[str, Any], content_format: str, media: list[MediaRef]) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise Unsupported("content that is neither a string nor a list")
    if role == "system":
        parts = _without_billing_header(parts)
    rendered = [p for p in (_part(part, content_format, media) for part in parts) if p is not None]
    if content_format == OPENAI:
        result: dict[str, Any] = {"role": role, "content": rendered}
    else:
        if any(not isinstance(p, str) for p in rendered):
            raise Unsupported("media in a template that takes content as a string")
        result = {"role": role, "content": "\n".join(rendered)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = copy.deepcopy(list(message["tool_calls"]))
        if message.get("reasoning") is not None:
            result["reasoning"] = result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        items = result["content"]
        if isinstance(items, list) and all(isinstance(i, dict) and i.get("type") == "text" for i in items):
            result["content"] = "\n".join(i.get("text", "") for i in items)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = copy.deepcopy(message.get("tools"))
    return result


def _part(part: Any, content_format: str, media: list[MediaRef]) -> Any:
    """One content part as the template sees it (None: dropped), recording media in `media`."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if content_format == OPENAI else part
    if not isinstance(part, dict):
        raise Unsupported("a content part that is not an object")
    part_type = part.get("type")
    if part_type is None or part.get("uuid") is not None:  # the type comes from the keys present
        part_type = next((k for k in ("image_url", "video_url") if k in part), None)
        if part_type is None:
            raise Unsupported("a content part without a type")
    if not isinstance(part_type, str):
        raise Unsupported("a content part type that is not a string")
    extra = {k: copy.deepcopy(v) for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
    if part_type in TEXT_PARTS:
        text = part.get(_TEXT_KEY.get(part_type, "text"))
        if text is None:
            return None
        if not isinstance(text, str):
            raise Unsupported("a text part whose text is not a string")
        return {"type": "text", "text": text, **extra} if content_format == OPENAI else text
    if part_type in _IMAGE_PARTS or part_type in _VIDEO_PARTS:
        key = _IMAGE_PARTS.get(part_type) or _VIDEO_PARTS[part_type]
        value = part.get(key)
        url = value.get("url") if isinstance(value, dict) else value
        kind = "image" if part_type in _IMAGE_PARTS else "video"
        media.append(MediaRef(kind, url if isinstance(url, str) else None))
        if content_format != OPENAI:
            return MediaRef(kind, None)  # refused by conversation(): string templates place media their own way
        return {"type": kind, **extra}
    raise Unsupported(f"content part type {part_type!r}")


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's per-request attribution line from system text (it would defeat prefix caching)."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and \
            part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_call_arguments_as_objects(message: dict[str, Any]) -> None:
    """Tool-call arguments as the templates expect them: objects, `{}` for what does not parse to one."""
    if message["role"] != "assistant" or "tool_calls" not in message:
        return
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
            raise Unsupported("a tool call that is not a function call")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                arguments = None
        function["arguments"] = arguments if isinstance(arguments, dict) and arguments else {}


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones, all system messages merged into one at the front where they move."""
    converted = []
    for message in messages:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    systems = [(i, m) for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or (len(systems) == 1 and systems[0][0] == 0):
        return converted
    texts = []
    for _, m in systems:
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) and "text" in p else p
                                for p in content if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in converted if m["role"] != "system")]


def tools_for_template(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` as the engine's request model dumps them: type and function (name, description, parameters, and
    strict / defer_loading only when given); other fields dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unsupported("`tools` is not a list")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Unsupported("a tool without a function name")
        shaped: dict[str, Any] = {"name": function["name"], "description": function.get("description"),
                                  "parameters": copy.deepcopy(function.get("parameters"))}
        defer = function.get("defer_loading", tool.get("defer_loading"))
        for key, value in (("strict", function.get("strict")), ("defer_loading", defer)):
            if value is not None:
                shaped[key] = value
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": shaped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out
