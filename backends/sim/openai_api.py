"""OpenAI wire shapes for the sim server: parse request bodies, build vLLM-shaped responses and chunks.

Owns validation (with vLLM's error messages and statuses) and the JSON of answers, SSE chunks
and usage; it holds no state and does not run anything (server.py does).
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

from backends.sim.tokens import MediaError, Prompt, chat_prompt, completion_prompt, exact_prompt

# Without max_tokens a real model stops at EOS after a length we cannot know; the sim picks a
# deterministic length in this range (per request seed) and finishes with "stop".
DEFAULT_OUTPUT_RANGE = (32, 256)


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


@dataclass
class ParsedRequest:
    """What the engine needs from one completion request."""

    kind: str  # "chat" or "completion"
    model: str
    prompt: Prompt
    max_tokens: int
    finish_reason: str  # at max_tokens: "length" when the client set it, else "stop"
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    seed: int
    response_role: str = "assistant"
    # disaggregated serving, as vLLM takes them (backends/sim/transfer.py, encoder.py)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None  # a chat stream's first delta: the last message's role without a generation prompt


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"{name} must be a positive integer, got {value!r}", param=name)
    return value


def parse_request(body: Any, kind: str, served_model: str, max_model_len: int, default_seed: int,
                  counter: Any = None) -> ParsedRequest:
    """`counter`: a real tokenizer's (proxy.tokens PromptCounter) to count prompts with, else the sim's own rule."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "the sim engine supports n=1 only", param="n")
    try:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise ApiError(400, "messages must be a non-empty list of objects", param="messages")
            add_generation_prompt = bool(body.get("add_generation_prompt", True))
            continue_final = bool(body.get("continue_final_message", False))
            if continue_final and add_generation_prompt:  # vLLM: its validator, or the chat template's
                raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
            if continue_final and messages[-1].get("role") != "assistant":
                raise ApiError(400, "Cannot set `continue_final_message` to True when the last message is not "
                                    "from the assistant.", param="messages")
            prompt = (exact_prompt(counter, body, True) if counter is not None else None) or chat_prompt(
                messages, add_generation_prompt, continue_final)
            response_role = "assistant" if add_generation_prompt else str(messages[-1].get("role", "assistant"))
        else:
            response_role = "assistant"
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
                raw = raw[0]  # a batch of one
            if isinstance(raw, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
                raise ApiError(400, "the sim engine takes one prompt: a string or a list of token ids", param="prompt")
            if not isinstance(raw, (str, list)) or not raw:
                raise ApiError(400, "prompt must be a non-empty string or list of token ids", param="prompt")
            prompt = (exact_prompt(counter, body, False) if counter is not None else None) or completion_prompt(raw)
    except MediaError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    prompt_len = len(prompt.token_ids)
    seed = body.get("seed")
    seed = default_seed if not isinstance(seed, int) else seed
    requested = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    if requested is not None:
        max_tokens, finish_reason = requested, "length"
    else:
        max_tokens = random.Random(seed).randint(*DEFAULT_OUTPUT_RANGE)
        max_tokens = min(max_tokens, max(max_model_len - prompt_len, 1))
        finish_reason = "stop"
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                            f"completion). Please reduce the length of the messages or completion.",
                       param="max_tokens" if requested else "messages")
    options = body.get("stream_options") or {}
    return ParsedRequest(kind=kind, model=served_model, prompt=prompt, max_tokens=max_tokens,
                         finish_reason=finish_reason, stream=bool(body.get("stream", False)),
                         include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
                         continuous_usage=bool(isinstance(options, dict) and options.get("include_usage")
                                               and options.get("continuous_usage_stats")),
                         seed=seed, response_role=response_role,
                         kv_transfer_params=_object(body, "kv_transfer_params"),
                         ec_transfer_params=_object(body, "ec_transfer_params"))


def _object(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise ApiError(400, f"{name} must be an object", param=name)
    return value


def new_request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's usage; a final one says how many prompt tokens came from the prefix cache, as vLLM started with
    --enable-prompt-tokens-details (as `kvroute worker` starts it) does."""
    details = {"cached_tokens": cached_tokens} if cached_tokens is not None else None
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details}


class ResponseBuilder:
    """Builds one request's response body or SSE chunks, shaped like vLLM's."""

    def __init__(self, request_id: str, parsed: ParsedRequest) -> None:
        self.request_id = request_id
        self.parsed = parsed
        self.created = int(time.time())
        self.chat = parsed.kind == "chat"

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.parsed.model,
                "choices": choices}

    def role_chunk(self, prompt_tokens: int | None = None) -> dict[str, Any] | None:
        """vLLM opens a chat stream with the role and empty content, when the engine's first output arrives
        (a chunk of its own, with continuous usage counting no completion token yet)."""
        if not self.chat:
            return None
        chunk = self._envelope([{"index": 0, "delta": {"role": self.parsed.response_role, "content": ""},
                                 "logprobs": None, "finish_reason": None}])
        if prompt_tokens is not None:
            chunk["usage"] = usage(prompt_tokens, 0)
        return chunk

    def token_chunk(self, text: str, finish_reason: str | None,
                    running_usage: tuple[int, int] | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        chunk = self._envelope([choice])
        if running_usage is not None:
            chunk["usage"] = usage(*running_usage)
        return chunk

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        chunk = self._envelope([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return chunk

    def full_response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                      cached_tokens: int, **transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        """The whole answer; `kv_transfer_params` / `ec_transfer_params` given are added as vLLM adds them."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                              "annotations": None, "audio": None, "function_call": None,
                                              "tool_calls": [], "reasoning_content": None},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.parsed.model,
                "choices": [choice], "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
                "prompt_logprobs": None, **{k: v for k, v in transfer_params.items() if v is not None}}
