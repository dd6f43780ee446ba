"""What to do after one failed upstream attempt: retry elsewhere, answer the client, and blame the worker or not.

Pure: a table from (status, body, exception kind, accepted, attempts, statuses seen) to a Verdict; no I/O,
no registry. The data plane asks it (proxy/dataplane/classify.py) and carries the verdict out.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

import orjson

# A worker's Retry-After up to this is waited out before the next attempt; a longer one goes back to the
# client with the 429 (the client is better placed to wait that long than a proxy holding a connection).
RETRY_AFTER_CAP_S = 5.0


class Failure(StrEnum):
    """How an attempt failed when the worker gave no HTTP answer."""

    CONNECT = "connect"   # no connection (refused, reset before the request went out, DNS): nothing ran
    TIMEOUT = "timeout"   # a deadline passed (connect, first byte, idle, total)
    BROKEN = "broken"     # the connection died after the request went out, before anything reached the client


class Action(StrEnum):
    RETRY = "retry"                  # try another worker (after delay_s)
    PASS_THROUGH = "pass_through"    # give the client the worker's answer as it is (status and body)
    CLIENT_ERROR = "client_error"    # the request caused it: answer `status` (4xx) with an OpenAI error body
    GATEWAY_TIMEOUT = "gateway_timeout"  # the worker took the request and did not answer in time: 504
    UNAVAILABLE = "unavailable"      # nothing to pass on and no attempts left: 503 no healthy worker


@dataclass(frozen=True, slots=True)
class Attempt:
    """One failed upstream attempt, as the forwarder saw it."""

    status: int | None = None           # the worker's HTTP status, when it answered
    body: bytes | None = None           # its body, when it answered and it could be read
    failure: Failure | None = None      # when it did not answer
    accepted: bool = False              # the request reached the worker (a connection carried it)
    retry_after: str | None = None      # the worker's Retry-After header


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    counts_against_worker: bool   # feed the worker's circuit breaker
    reason: str                   # metrics label and log word
    delay_s: float = 0.0          # wait this long before the retry
    status: int | None = None     # CLIENT_ERROR: the status to answer
    code: str | None = None       # CLIENT_ERROR / GATEWAY_TIMEOUT: OpenAI error code
    message: str | None = None    # CLIENT_ERROR / GATEWAY_TIMEOUT: OpenAI error message


# Texts of a 500 that the request itself caused. vLLM's media connector turns a 4xx from the media host
# into 422 "Failed to fetch media from URL: ...", but a host it cannot reach or that times out surfaces as
# aiohttp's own exception text in a 500 ("Cannot connect to host ...", "Connection timeout to host ...");
# PIL's "cannot identify image file" is a 400 in vLLM 0.32 but a 500 in older versions.
_MEDIA_FAILURE = re.compile(
    r"failed to fetch media|cannot connect to host|connection timeout to host|timeout on reading data from socket"
    r"|cannot identify image file|failed to (?:load|decode|download|open) (?:the )?(?:image|video|audio|media)"
    r"|the url must be either a http, data or file url|invalid (?:image|video|audio) url"
    r"|image_url|video_url|audio_url|unidentifiedimageerror|media download", re.IGNORECASE)
_CONTEXT_LENGTH = re.compile(
    r"maximum context length|longer than the maximum model length|exceeds the model's maximum|"
    r"context length exceeded|too long for the model|max_model_len", re.IGNORECASE)
_RETRY_ON_STATUS = frozenset({502, 503, 504})


def classify(attempt: Attempt, attempts_made: int, max_attempts: int,
             statuses_seen: Collection[int] = ()) -> Verdict:
    """The verdict on `attempt`, the `attempts_made`-th of at most `max_attempts` (retries + 1).

    `statuses_seen` holds the statuses of the earlier attempts of the same request (not this one).
    """
    verdict = _classify(attempt, statuses_seen)
    if verdict.action is Action.RETRY and attempts_made >= max_attempts:
        if attempt.status is not None and attempt.body is not None:
            return Verdict(Action.PASS_THROUGH, verdict.counts_against_worker, verdict.reason)
        if attempt.failure is Failure.TIMEOUT and attempt.accepted:
            return _gateway_timeout(verdict.reason)
        return Verdict(Action.UNAVAILABLE, verdict.counts_against_worker, verdict.reason)
    return verdict


def _classify(attempt: Attempt, statuses_seen: Collection[int]) -> Verdict:
    status = attempt.status
    if status is None:
        failure = attempt.failure or Failure.BROKEN
        if failure is Failure.TIMEOUT and attempt.accepted:
            # It may still be generating; a second worker would run the same long request again.
            return _gateway_timeout("timeout")
        if failure is Failure.TIMEOUT:
            return Verdict(Action.RETRY, True, "connect_timeout")
        # A worker that died under a request that had not reached the client yet: start it again elsewhere.
        return Verdict(Action.RETRY, True, "connect_error" if failure is Failure.CONNECT else "broken")
    message = _error_message(attempt.body)
    if status == 429:
        delay = _retry_after_s(attempt.retry_after)
        if delay is not None and delay > RETRY_AFTER_CAP_S:
            return Verdict(Action.PASS_THROUGH, False, "status_429")
        return Verdict(Action.RETRY, False, "status_429", delay_s=delay or 0.0)
    if status in _RETRY_ON_STATUS:
        return Verdict(Action.RETRY, False, f"status_{status}")
    if 400 <= status < 500:
        if _is_openai_error(attempt.body):  # the engine said what was wrong, in the client's format already
            return Verdict(Action.PASS_THROUGH, False, f"status_{status}")
        return Verdict(Action.CLIENT_ERROR, False, f"status_{status}", status=status, code="invalid_request",
                       message=message or f"The worker refused the request (HTTP {status}).")
    if status == 500 and message is not None:
        if _CONTEXT_LENGTH.search(message):
            return Verdict(Action.CLIENT_ERROR, False, "context_length", status=400, code="context_length_exceeded",
                           message=message)
        if _MEDIA_FAILURE.search(message):
            return Verdict(Action.CLIENT_ERROR, False, "media_unavailable", status=400, code="invalid_media",
                           message=f"The engine could not fetch or decode media in this request: {message}")
    if status == 500:
        if 500 in statuses_seen:  # a second worker failing the same way: the request is the likelier cause
            return Verdict(Action.PASS_THROUGH, False, "status_500")
        return Verdict(Action.RETRY, False, "status_500")
    return Verdict(Action.PASS_THROUGH, False, f"status_{status}")


def _gateway_timeout(reason: str) -> Verdict:
    return Verdict(Action.GATEWAY_TIMEOUT, True, reason, status=504, code="worker_timeout",
                   message="The worker accepted the request but did not answer in time; it was not retried "
                           "elsewhere, as it may still have been running.")


def _error_message(body: bytes | None) -> str | None:
    """The engine's error message: OpenAI's error.message, a FastAPI detail, or the text itself."""
    if not body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:2000].decode(errors="replace").strip() or None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(data.get(key), str):
                return data[key]
    return None


def _is_openai_error(body: bytes | None) -> bool:
    if not body:
        return False
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After in seconds (the delta form; an HTTP date counts as 'longer than the cap')."""
    if value is None:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return RETRY_AFTER_CAP_S * 2
