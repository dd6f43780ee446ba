"""Mid-stream migration: may a stream continue on another worker, the continuation's body, and the tracker
that reads the SSE events relayed to the client (text and tokens so far) and rewrites a continuation's.

Owns the OpenAI / vLLM wire details of continuing a generation (continue_final_message, prompt + text, reduced
max_tokens, the first stream's id/created/model, usage of the whole answer); bytes and deadlines are
exchange.py's, choosing the next worker and the migration limit journey.py's.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.request import CHAT
from proxy.workers.registry import Worker

# Engines whose OpenAI server continues a final assistant message (vLLM's continue_final_message); LMDeploy's
# api_server (turbomind, pytorch, and its /nodes/add registrations) does not.
CONTINUES_CHAT = frozenset({"vllm", "sim"})
# Structured output restarts its grammar at the first generated token: a continuation would break it.
_STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")
# One SSE event larger than this is not an answer chunk: the stream is treated as broken.
MAX_EVENT_BYTES = 4 * 1024 * 1024
# Text kept per stream for a continuation, unless the config says otherwise (proxy.limits.max_migration_text_bytes).
MAX_TEXT_BYTES = 4 * 1024 * 1024
# Small text pieces are joined by this many: each str costs ~50 bytes besides its text.
_JOIN_PIECES = 256
# Relayed events held unread up to this many bytes per stream (~600 of vLLM's chunks), then read in one go:
# most answers are never read at all; a long one pays orjson's parse once per chunk, in batches.
COMPACT_BYTES = 128 * 1024


def refusal(payload: dict[str, Any], kind: str) -> str | None:
    """Why a streamed request could not continue on another worker (None: it could)."""
    if kind == CHAT and _REFUSAL_KEYS.isdisjoint(payload):  # the usual request names none of them
        return None
    if payload.get("n", 1) not in (1, None) or payload.get("best_of", 1) not in (1, None):
        return "n>1"
    if payload.get("logprobs") not in (None, False) or payload.get("top_logprobs") is not None:
        return "logprobs"
    if payload.get("echo"):
        return "echo"
    if any(payload.get(key) is not None for key in ("tools", "tool_choice", "functions", "function_call")):
        return "tools"
    if any(payload.get(key) is not None and payload.get(key) != {"type": "text"} for key in _STRUCTURED):
        return "structured_output"
    if kind == CHAT:
        messages = payload.get("messages")
        if payload.get("continue_final_message") and not (
                isinstance(messages, list) and messages and isinstance(messages[-1], dict)
                and isinstance(messages[-1].get("content"), str)):
            return "continue_final_message"
        return None
    if _prompt_text(payload.get("prompt")) is None:
        return "token_prompt"
    return None


# Every key refusal() reads: a chat request with none of them can continue.
_REFUSAL_KEYS = frozenset(("n", "best_of", "logprobs", "top_logprobs", "echo", "tools", "tool_choice", "functions",
                           "function_call", "continue_final_message", *_STRUCTURED))


def engine_continues(worker: Worker, kind: str) -> bool:
    """`worker`'s engine takes a continuation of `kind` (a completion prompt + text: every engine)."""
    if kind != CHAT:
        return True
    if worker.engine in CONTINUES_CHAT:
        return True
    # a worker added by URL alone: a plain `vllm serve` (static config); LMDeploy comes through /nodes/add
    return worker.engine == "unknown" and worker.source != "nodes"


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def continuation_body(payload: dict[str, Any], kind: str, served: str, text: str, sent_tokens: int) -> bytes:
    """The request that continues a generation of which `text` (`sent_tokens` tokens) reached the client."""
    body = dict(payload)
    body["model"] = served
    if text:
        if kind == CHAT:
            messages = list(payload["messages"])
            if payload.get("continue_final_message"):  # the client's own prefill: extend it
                last = dict(messages[-1])
                last["content"] = last["content"] + text
                messages[-1] = last
            else:
                messages.append({"role": "assistant", "content": text})
            body["messages"] = messages
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        else:
            body["prompt"] = _prompt_text(payload.get("prompt")) + text
    for key in ("max_tokens", "max_completion_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = max(1, value - sent_tokens)
    value = payload.get("min_tokens")
    if isinstance(value, int) and not isinstance(value, bool):
        body["min_tokens"] = max(0, value - sent_tokens)
    return orjson.dumps(body)


def token_budget_left(payload: dict[str, Any], sent_tokens: int) -> bool:
    """The client's max_tokens leaves room for more than what was sent."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value - sent_tokens > 0
    return True


class StreamTracker:
    """One client's SSE stream across the workers that serve it: what reached the client, and the rewriting
    of a continuation's events into the first stream's (same id, created, model; usage of the whole answer).

    Only whole events are passed on; at most one partial event is held (dropped if its worker dies). A first
    stream's events are read lazily: once its first chunk is read, relayed events are kept as bytes and read
    (in one JSON parse per batch) only when a migration asks what reached the client, or every COMPACT_BYTES
    to bound what is held. An event that may be an error, or an unusual [DONE], is read at once. At most
    `max_text_bytes` of text is kept: past it the stream is relayed on, and cannot move to another worker."""

    __slots__ = ("chat", "include_usage", "partial", "texts", "joined", "text_room", "_text_limited", "_tokens",
                 "base", "_prompt_tokens", "id", "created", "model", "continuation", "_finished", "done", "broken",
                 "_blocker", "framing", "migrations", "passthrough", "lazy", "unread", "unread_bytes")

    def __init__(self, chat: bool, include_usage: bool, max_text_bytes: int = MAX_TEXT_BYTES) -> None:
        self.chat = chat
        self.include_usage = include_usage
        self.partial = b""
        self.texts: list[str] = []   # the newest pieces of text that reached the client
        self.joined: list[str] = []  # the older ones, _JOIN_PIECES to a string
        self.text_room = max_text_bytes  # UTF-8 bytes of text that may still be kept
        self._text_limited = False   # the text outgrew it: none is kept, and the stream cannot move
        self._tokens = 0           # completion tokens the client has got (all workers)
        self.base = 0              # of which those sent before the current worker took over
        self._prompt_tokens: int | None = None  # the original request's, once a chunk said it
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.continuation = False  # the current worker continues another's generation
        self._finished = False     # a finish_reason reached the client
        self.done = False          # data: [DONE] reached the client
        self.broken: str | None = None   # the current worker's stream cannot be read on
        self._blocker: str | None = None  # seen in the stream: what makes it impossible to continue
        self.framing = 0           # the client body's framing (relay.py's CHUNKED / CLOSE)
        self.migrations = 0
        self.passthrough = False   # not an OpenAI chunk stream: relayed as bytes, no longer read
        self.lazy = False          # the first chunk was read: later events wait in `unread`
        self.unread: list[bytes] = []  # whole events relayed but not read yet
        self.unread_bytes = 0

    # What reached the client; each reads what is unread first.
    @property
    def text(self) -> str:
        self._catch_up()
        return "".join(self.joined) + "".join(self.texts)

    @property
    def tokens(self) -> int:
        self._catch_up()
        return self._tokens

    @property
    def finished(self) -> bool:
        self._catch_up()
        return self._finished

    @property
    def blocker(self) -> str | None:
        self._catch_up()
        return self._blocker

    @property
    def text_limited(self) -> bool:
        """The text outgrew its bound (read only when the unread events could hold what is left of it)."""
        if not self._text_limited and self.unread_bytes > self.text_room:
            self._catch_up()
        return self._text_limited

    @property
    def prompt_tokens(self) -> int | None:
        self._catch_up()
        return self._prompt_tokens

    def begin_continuation(self) -> None:
        """The next bytes come from a worker continuing the generation."""
        self._catch_up()
        self.partial = b""
        self.base = self._tokens
        self.continuation = True
        self.broken = None
        self.migrations += 1

    def feed(self, data: bytes) -> bytes:
        """Bytes from the worker -> bytes for the client (whole events, rewritten when continuing)."""
        if self.passthrough:
            return data
        if self.broken is not None:
            return b""
        if self.lazy and not self.partial and not self.continuation and data.endswith(b"\n\n") \
                and b"\r" not in data and self._defer(data):
            return data  # the usual piece of a read stream: whole events, kept unread
        buf = self.partial + data if self.partial else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self.partial = buf
            if len(buf) > MAX_EVENT_BYTES:
                self.broken = "an SSE event larger than any answer chunk"
            return b""
        whole, self.partial = buf[:end + 2], buf[end + 2:]
        if not self.continuation:
            if self.lazy and self._defer(whole):
                return whole
            self._catch_up()
            if self.passthrough:  # what was unread was not a chunk stream after all
                partial, self.partial = self.partial, b""
                return whole + partial
            events = whole.split(b"\n\n")
            events.pop()  # the empty piece after the last separator
            read = 0
            may_defer = not self.lazy
            for i, event in enumerate(events):
                if self._read(event) is None:  # broken: pass on what came before it
                    return b"".join(e + b"\n\n" for e in events[:i])
                if self.passthrough:  # from here on, bytes as they come
                    partial, self.partial = self.partial, b""
                    return whole + partial
                read += len(event) + 2
                if may_defer and self.lazy and read < len(whole):  # the first chunk is read: the rest may wait
                    may_defer = False
                    if self._defer(whole[read:]):
                        return whole
            return whole
        events = whole.split(b"\n\n")
        events.pop()
        out = []
        for event in events:
            rewritten = self._read(event)
            if rewritten is None:
                break
            if rewritten:
                out.append(rewritten)
        return b"".join(out)

    def _defer(self, whole: bytes) -> bool:
        """Keep `whole` (events relayed to the client) unread, unless it may hold an error event or a [DONE]
        that is not plainly the last event: False, and it is read now."""
        if b'"error"' in whole:
            return False
        if b"[DONE]" in whole:
            if not (whole.endswith(b"data: [DONE]\n\n") and whole.count(b"[DONE]") == 1
                    and (len(whole) == 14 or whole[-16:-14] == b"\n\n")):
                return False
            self.done = True
            whole = whole[:-14]
            if not whole:
                return True
        self.unread.append(whole)
        self.unread_bytes += len(whole)
        if self.unread_bytes >= COMPACT_BYTES:
            self._catch_up()
        return True

    def _catch_up(self) -> None:
        """Read the events relayed unread: as one JSON array when each is a plain `data: {...}` event (vLLM's
        and the sim's), else one by one. Something unreadable among them was relayed already: the stream
        can no longer be continued, and is not read further."""
        unread = self.unread
        if not unread:
            return
        self.unread = []
        self.unread_bytes = 0
        batch = unread[0] if len(unread) == 1 else b"".join(unread)
        chunks = _plain_events(batch)
        if chunks is not None:
            for obj in chunks:
                if not isinstance(obj, dict) or "error" in obj:
                    break
                self._take(obj)
            else:
                return
            self._blocker, self.passthrough = "an unreadable stream event", True
            return
        events = batch.split(b"\n\n")
        events.pop()
        for event in events:
            if self._read(event) is None:
                self.broken = None  # relayed already: not this worker's failure, but no continuing after it
                self._blocker, self.passthrough = "an unreadable stream event", True
                return
            if self.passthrough:
                return

    def _read(self, event: bytes) -> bytes | None:
        """Record one event; what to send for it (b"": nothing), or None when the stream is broken."""
        if event.startswith(b"data: ") and b"\n" not in event:  # vLLM's and the sim's: one data line
            data = event[6:]
        else:
            data = b""
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    piece = line[5:]
                    data += piece[1:] if piece.startswith(b" ") else piece
        if not data:
            return event + b"\n\n" if not self.continuation else b""  # a comment or keep-alive
        if data == b"[DONE]":
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            if self.continuation:
                self.broken = "an unreadable stream event"
                return None
            self._blocker = "not an OpenAI chunk stream"
            self.passthrough = True
            return b""
        if not isinstance(obj, dict) or "error" in obj:
            self.broken = "an error event in the stream"
            return None
        if not self.continuation:
            self.lazy = True  # a chunk stream: later events may wait until asked for
        return self._take(obj)

    def _take(self, obj: dict[str, Any]) -> bytes:
        """Record one chunk; what to send for it (b"": nothing, or the chunk as relayed)."""
        choices = obj.get("choices")
        usage = obj.get("usage")
        if self.id is None and not self.continuation:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        role_only = False
        if choices:
            choice = choices[0] if isinstance(choices, list) and isinstance(choices[0], dict) else {}
            if len(choices) != 1:
                self._blocker = "n>1"
            if choice.get("logprobs") is not None:
                self._blocker = "logprobs"
            if self.chat:
                delta = choice.get("delta") or {}
                if len(delta) > 1 or "content" not in delta:  # anything but plain content: look closer
                    if delta.get("tool_calls") or delta.get("function_call"):
                        self._blocker = "tools"
                    if delta.get("reasoning_content") or delta.get("reasoning"):
                        self._blocker = "reasoning"
                    role_only = "role" in delta and not delta.get("content") and choice.get("finish_reason") is None
                content = delta.get("content")
            else:
                content = choice.get("text")
            if not role_only:
                if isinstance(content, str) and content and not self._text_limited:
                    self._keep(content)
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    self._tokens = self.base + usage["completion_tokens"]  # continuous_usage_stats: exact
                else:
                    self._tokens += 1  # vLLM and the sim stream one token per chunk
                if choice.get("finish_reason") is not None:
                    self._finished = True
        if isinstance(usage, dict) and not self.continuation and self._prompt_tokens is None:
            if isinstance(usage.get("prompt_tokens"), int):
                self._prompt_tokens = usage["prompt_tokens"]
        if not self.continuation:
            return b""  # passed on unchanged by feed()
        if role_only:
            return b""  # the client had its role chunk from the first worker
        obj["id"], obj["created"], obj["model"] = self.id, self.created, self.model
        if isinstance(usage, dict):
            obj["usage"] = self._whole_usage(usage)
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _keep(self, content: str) -> None:
        """Keep text that reached the client, while the bound allows (a continuation resends all of it)."""
        self.text_room -= len(content) if content.isascii() else len(content.encode())
        if self.text_room < 0:
            self._text_limited = True
            self.texts, self.joined = [], []
            self._blocker = self._blocker or "an answer longer than proxy.limits.max_migration_text_bytes"
            return
        texts = self.texts
        texts.append(content)
        if len(texts) >= _JOIN_PIECES:
            self.joined.append("".join(texts))
            self.texts = []

    def _whole_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        usage = dict(usage)
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            usage["completion_tokens"] = completion + self.base
        prompt = usage.get("prompt_tokens")
        if self._prompt_tokens is not None:
            usage["prompt_tokens"] = self._prompt_tokens
        elif isinstance(prompt, int):
            # the continuation's prompt is the original's plus the text so far (as many tokens, near enough)
            usage["prompt_tokens"] = max(0, prompt - self.base)
        if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            usage["prompt_tokens_details"] = None  # the continuation's cache hits are not the request's
        return usage

    def closing(self) -> bytes:
        """The end of a stream whose answer was complete when its worker failed (finish_reason sent)."""
        self._catch_up()
        out = b""
        if self.include_usage and self.prompt_tokens is not None:
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                     "total_tokens": self.prompt_tokens + self.tokens}
            obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": [], "usage": usage}
            out = b"data: " + orjson.dumps(obj) + b"\n\n"
        return out + b"data: [DONE]\n\n"


def _plain_events(batch: bytes) -> list[Any] | None:
    """`data: {...}\\n\\n` events, each one line, parsed as one JSON array; None when they are not all so."""
    events = batch.count(b"\n\n")
    if (not events or batch.count(b"\n") != 2 * events or batch.count(b"data: ") != events
            or not batch.startswith(b"data: ")):
        return None
    try:
        parsed = orjson.loads(b"[" + batch[6:-2].replace(b"\n\ndata: ", b",") + b"]")
    except orjson.JSONDecodeError:
        return None
    return parsed if len(parsed) == events else None
