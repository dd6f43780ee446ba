"""A model's chat template: chosen, compiled and rendered as the engine does (transformers' Jinja environment).

Owns which template applies (the engine's --chat-template, else the processor's unless the request has tools,
else the tokenizer's, by name where it has several), the sandboxed environment transformers renders in
(trim_blocks, lstrip_blocks, loop controls, a pass-through `generation` block, its `tojson`), how a template
takes message content (vLLM's rule: a loop over a message's content means content parts, else one string),
and `continue_final_message`. What the conversation looks like is conversation.py's.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.tokens.conversation import OPENAI, STRING

# The named special tokens transformers passes to every template (its special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateUnavailable(ValueError):
    """No chat template applies, or it failed to render this request (the engine then answers for it)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' own filter: json.dumps, no HTML escaping, non-ASCII kept
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """One compiled template and what the engine derives from its source."""

    def __init__(self, source: str) -> None:
        self.source = source
        env = _environment()
        try:
            self._template = env.from_string(source)
            tree = env.parse(source)
        except jinja2.TemplateError as exc:
            raise TemplateUnavailable(f"the chat template does not compile: {exc}") from None
        self.content_format = content_format(tree)
        # the names it reads: vLLM passes a request's chat_template_kwargs on only where the template reads them
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(tree))
        # vLLM turns developer messages into system ones unless the template names the role
        self.has_developer_role = '"developer"' in source or "'developer'" in source

    def render(self, messages: list[dict[str, Any]], variables: dict[str, Any],
               continue_final_message: bool) -> str:
        """The prompt text; TemplateUnavailable when the template raises (as it would in the engine)."""
        final_text = None
        if continue_final_message:
            messages, final_text = _tag_final_message(messages)
        try:
            text = self._template.render(messages=messages, **variables)
        except Exception as exc:  # a template may raise anything (raise_exception, a bad attribute, ...)
            raise TemplateUnavailable(f"the chat template failed: {exc}") from None
        return text if final_text is None else _cut_at_tag(text, final_text)


def _tag_final_message(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """transformers' continue_final_message: mark the end of the last message's (last) text, render, cut there."""
    messages = [*messages[:-1], dict(messages[-1])]
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
        return messages, content
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final = part["text"]
                part["text"] = final + _CONTINUE_TAG
                last["content"] = parts
                return messages, final
    raise TemplateUnavailable("continue_final_message without text to continue")


def _cut_at_tag(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise TemplateUnavailable("the template dropped the final message that continue_final_message continues")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


# --- which template -------------------------------------------------------------------------
class TemplateSet:
    """The templates a checkpoint carries; `select(tools)` is the one the engine renders a request with."""

    def __init__(self, engine: str | None, processor: str | None, tokenizer: str | dict[str, str] | None,
                 content_format: str | None = None) -> None:
        self._engine, self._processor, self._tokenizer = engine, processor, tokenizer
        self._content_format = content_format if content_format in (OPENAI, STRING) else None  # the engine's flag
        self._compiled: dict[str, ChatTemplate] = {}

    def select(self, has_tools: bool) -> ChatTemplate:
        source = self._engine
        if source is None and not has_tools:
            source = self._processor
        if source is None:
            source = self._tokenizer_template(has_tools)
        if source is None:
            raise TemplateUnavailable("the model has no chat template")
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = ChatTemplate(source)
            if self._content_format is not None:
                compiled.content_format = self._content_format
        return compiled

    def _tokenizer_template(self, has_tools: bool) -> str | None:
        named = self._tokenizer
        if not isinstance(named, dict):
            return named
        if has_tools and "tool_use" in named:
            return named["tool_use"]
        return named.get("default")


def tokenizer_template(config: dict[str, Any] | None, jinja_file: str | None) -> str | dict[str, str] | None:
    """tokenizer_config.json's chat_template (a string, or a list of named templates), else chat_template.jinja."""
    value = (config or {}).get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value
                 if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        return named or jinja_file
    return jinja_file


def special_tokens(config: dict[str, Any] | None) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json, as strings."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = (config or {}).get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


# --- how the template takes message content (vLLM's detection, on the template's syntax tree) ------
def content_format(root: jinja2.nodes.Template) -> str:
    """OPENAI when the template loops over a message's content (or a macro parameter given it), else STRING."""
    return OPENAI if next(_content_loops(root), None) is not None else STRING


def _content_loops(root: jinja2.nodes.Node) -> Iterator[jinja2.nodes.For]:
    message_vars = {target for _, target in _loops_over(root, _names_bound_to(root, "messages"))}
    macro_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = [a.name for a in macro.args]
        params = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(names) and any(_access(arg, v, "content") for v in message_vars):
                        params.add(names[i])
                for kw in call.kwargs:
                    if kw.key in names and any(_access(kw.value, v, "content") for v in message_vars):
                        params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_access(it, v, "content") for v in message_vars):
            yield loop
        elif isinstance(it, jinja2.nodes.Name) and (it.name in macro_params.get(id(loop), ())
                                                     or (id(loop) not in in_macros and it.name == "content")):
            yield loop


def _names_bound_to(root: jinja2.nodes.Node, name: str) -> set[str]:
    """`name` and every variable assigned from it (or a slice or filter of it), transitively."""
    found, queue = {name}, deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and _access(assign.node, current) and target.name not in found:
                found.add(target.name)
                queue.append(target.name)
    return found


def _loops_over(root: jinja2.nodes.Node, names: set[str]) -> Iterator[tuple[jinja2.nodes.For, str]]:
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_access(loop.iter, n) for n in names):
            yield loop, loop.target.name


def _access(node: jinja2.nodes.Node, var: str, key: str | None = None) -> bool:
    """`node` reads `var` (or `var.key` / `var[key]`), possibly through filters, tests or a slice."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _access(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _access(node.node, var, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == var
    if isinstance(node, jinja2.nodes.Getitem):
        return _access(node.node, var) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _access(node.node, var) and node.attr == key
    return False
