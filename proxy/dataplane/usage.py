"""What an engine's answer said of its prompt: `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`,
read from the last bytes the client was sent, where the client itself gets them.

Owns finding the usage object in a bounded tail of the answer (never a parse of a whole body): a non-streamed
answer's end, or a stream's last events when the client asked for `stream_options.include_usage` (otherwise a
stream carries no usage, and none is added: the client gets exactly what the engine sent). Not what the numbers
mean (proxy/routing/cache_feedback.py).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from proxy.dataplane.outcome import Relayed
from proxy.dataplane.relay import Relay
from proxy.request import RoutedRequest
from proxy.routing.cache_feedback import AnswerUsage

# vLLM ends an answer with `"usage":{...},"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":
# null}` and a stream with its usage chunk and [DONE]: the last few hundred bytes hold it unless the answer asked
# for prompt logprobs (then it is left unread).
TAIL_BYTES = 4096
# The usage object's end: usage nests at most two levels (prompt_tokens_details.multimodal_tokens).
MAX_USAGE_BYTES = 1024
_BRACES = re.compile(rb"[{}]")


def answered_usage(routed: RoutedRequest, relay: Relay, outcome: object) -> AnswerUsage | None:
    """The usage of a whole, successful answer relayed through `relay`; None when it had none to read."""
    if (not isinstance(outcome, Relayed) or outcome.status != 200 or outcome.worker_failed
            or outcome.client_gone):
        return None
    if routed.stream:
        options = routed.payload.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage")):
            return None
    last = relay.tail
    if len(last) < TAIL_BYTES and relay.tail_before:  # a stream's usage event and its [DONE] may come apart
        last = relay.tail_before[len(last) - TAIL_BYTES:] + last
    return usage_in(last[-TAIL_BYTES:])


def usage_in(tail: bytes) -> AnswerUsage | None:
    """The last `"usage": {...}` object in `tail` (a JSON body's end, or SSE events), if whole and readable."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.find(b"{", at + 7, at + 16)
    if start < 0 or tail[at + 7:start].strip() != b":":
        return None  # `"usage": null`, or the word inside a string
    depth = 0
    for brace in _BRACES.finditer(tail, start, start + MAX_USAGE_BYTES):
        depth += 1 if brace.group() == b"{" else -1
        if depth == 0:
            try:
                usage = orjson.loads(tail[start:brace.end()])
            except orjson.JSONDecodeError:
                return None
            return _numbers(usage) if isinstance(usage, dict) else None
    return None


def _numbers(usage: dict[str, Any]) -> AnswerUsage:
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return AnswerUsage(prompt if type(prompt) is int else None, cached if type(cached) is int else None)
