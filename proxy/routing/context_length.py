"""Whether an engine takes a prompt of its length, by vLLM 0.32's rule, and its answer when it does not.

Owns the rule: the prompt must leave room for one generated token (prompt < max_model_len), and a max_tokens
(max_completion_tokens) the client gives may not exceed max_model_len; one larger than what the prompt leaves
is cut to that (not refused), and none given means all that is left. A refusal carries the engine's own
message, by the check it would fail first. Only an exact count is judged: an estimated prompt fits every
worker, and the engine answers for it.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import ProxyError
from proxy.request import RoutedRequest


def context_need(routed: RoutedRequest) -> int:
    """The max_model_len a worker needs to take `routed`; 0 (every worker) when its prompt was not counted exactly."""
    if not routed.exact_tokens:
        return 0
    _, max_tokens = explicit_max_tokens(routed.payload)
    return max(routed.prompt_tokens + 1, max_tokens)


def context_refusal(routed: RoutedRequest, limit: int) -> ProxyError:
    """The engine's 400 for `routed` on workers whose max_model_len is at most `limit`, checked in its order."""
    prompt = routed.prompt_tokens
    param, max_tokens = explicit_max_tokens(routed.payload)
    counted = routed.tokens.counted if routed.tokens is not None and routed.tokens.ready else None
    # the engine checks the text's tokens (one per image) before it expands each image to its tokens
    before_images = prompt - routed.media_tokens + (len(counted.media) if counted is not None else 0)
    max_chars = limit * counted.max_chars_per_token if counted is not None else 0
    if max_tokens > limit:
        value = max_tokens
        message = f"{param}={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer output tokens."
    elif counted is not None and 0 < max_chars < counted.text_chars:  # refused before tokenizing, by length
        param, value = "input_text", counted.text_chars
        message = (f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                   f"{counted.text_chars} characters (more than {max_chars} characters, which is the upper bound "
                   f"for {limit} input tokens). Please reduce the length of the input prompt.")
    elif before_images > limit:  # it stops tokenizing one past its limit, so it says "at least" that many
        param, value = "input_tokens", limit + 1
        message = (f"This model's maximum context length is {limit} tokens. However, your prompt contains at least "
                   f"{limit + 1} input tokens, which exceeds this limit even without any output tokens. Please reduce "
                   f"the length of the input prompt.")
    elif prompt > limit:
        return ProxyError(400, f"Input length ({prompt}) exceeds model's maximum context length ({limit}).",
                          "invalid_request_error", code="context_length_exceeded")
    else:  # prompt == limit: nothing left to generate, the engine's max_tokens comes out 0
        param, value = "max_tokens", 0
        message = "max_tokens must be at least 1, got 0."
    return ProxyError(400, f"{message} (parameter={param}, value={value})", "invalid_request_error",
                      code="context_length_exceeded", param=param)


def explicit_max_tokens(payload: dict[str, Any]) -> tuple[str, int]:
    """(its name, the output limit the client gave): max_completion_tokens, else max_tokens; 0 when neither."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if value is not None:
            return key, value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
    return "max_tokens", 0
