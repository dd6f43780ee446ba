"""The bodies a split request's stages send, in vLLM's disaggregated-serving protocol, and what their answers give.

Owns the wire details: the prefill leg is the request with `kv_transfer_params: {"do_remote_decode": true}` (and the
remote fields null, as vLLM's own proxy sends them), one output token, not streamed, without streaming options or
minimum lengths; the encode leg the same without KV params; the decode leg the original request with the params the
prefill answer gave (and the encoder's `ec_transfer_params`); a release hands params nobody will use back to the
prefill worker through a decode worker that refuses them. One orjson dump per leg; nothing here does I/O.
"""

from __future__ import annotations

from typing import Any

import orjson

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
# Keys a one-token leg cannot honour: vLLM's proxy drops them for the prefill worker (the decode worker gets them).
_ONE_TOKEN_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")
# A model name no worker serves: vLLM 0.32 answers 404 and, as it does for any request with remote-prefill params
# that its serving layer refuses, tells its KV connector to free those blocks on the prefill worker (NIXL: an empty
# read notification). The sim does the same.
RELEASE_MODEL = "kvroute-release-kv"


def _one_token(payload: dict[str, Any], served: str) -> dict[str, Any]:
    body = dict(payload)
    body["model"] = served
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in _ONE_TOKEN_DROPS:
        body.pop(key, None)
    return body


def encode_body(payload: dict[str, Any], served: str) -> bytes:
    """What an encode worker gets (vLLM's encoder-only instance answers it with ec_transfer_params, no tokens)."""
    return orjson.dumps(_one_token(payload, served))


def prefill_body(payload: dict[str, Any], served: str, ec_params: dict[str, Any] | None) -> bytes:
    """What a prefill worker gets: compute the prompt's KV, keep it for a decode worker, answer one token."""
    body = _one_token(payload, served)
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    if ec_params:
        body["ec_transfer_params"] = ec_params
    return orjson.dumps(body)


def decode_body(payload: dict[str, Any], original: bytes, served: str, kv_params: dict[str, Any] | None,
                ec_params: dict[str, Any] | None) -> bytes:
    """What the worker that generates gets: the client's request, with what the earlier stages handed over
    (`original`, the bytes a whole request sends, when there is nothing to add)."""
    if not kv_params and not ec_params:
        return original
    body = dict(payload)
    body["model"] = served
    if kv_params:
        body["kv_transfer_params"] = kv_params
    if ec_params:
        body["ec_transfer_params"] = ec_params
    return orjson.dumps(body)


def release_body(kv_params: dict[str, Any]) -> bytes:
    """A completion request a decode worker refuses (unknown model), carrying params whose blocks it then frees."""
    return orjson.dumps({"model": RELEASE_MODEL, "prompt": [0], "max_tokens": 1, "kv_transfer_params": kv_params})


def answer_params(body: bytes, key: str) -> dict[str, Any] | None:
    """The `key` object of a worker's JSON answer (kv_transfer_params, ec_transfer_params); None when absent."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    value = answer.get(key) if isinstance(answer, dict) else None
    return value if isinstance(value, dict) and value else None
