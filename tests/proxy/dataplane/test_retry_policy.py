"""The retry table: which failed attempts move to another worker, which go back to the client, and which
count against the worker's circuit breaker (proxy/dataplane/retry_policy.py)."""

from __future__ import annotations

import orjson
import pytest

from proxy.dataplane.retry_policy import RETRY_AFTER_CAP_S, Action, Attempt, Failure, classify


def _openai(message: str, err_type: str = "BadRequestError", code: int = 400) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}})


# vLLM 0.32's 500 bodies for an image URL it cannot reach (aiohttp's exception text, as vLLM renders it).
UNREACHABLE_IMAGE = _openai("Cannot connect to host 10.255.255.1:80 ssl:default [Connect call failed "
                            "('10.255.255.1', 80)]", "InternalServerError", 500)
IMAGE_TIMEOUT = _openai("Connection timeout to host http://10.255.255.1/cat.png", "InternalServerError", 500)
UNDECODABLE_IMAGE = _openai("cannot identify image file <_io.BytesIO object>", "InternalServerError", 500)
CONTEXT_TOO_LONG = _openai("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens",
                           "InternalServerError", 500)
ENGINE_CRASHED = _openai("EngineCore encountered an issue. See stack trace (above) for the root cause.",
                         "InternalServerError", 500)


def test_a_connect_error_is_retried_and_counts_against_the_worker():
    v = classify(Attempt(failure=Failure.CONNECT), attempts_made=1, max_attempts=3)
    assert (v.action, v.counts_against_worker) == (Action.RETRY, True)


def test_a_worker_that_died_under_a_request_not_yet_answered_is_retried_and_blamed():
    v = classify(Attempt(failure=Failure.BROKEN, accepted=True), 1, 3)
    assert (v.action, v.counts_against_worker) == (Action.RETRY, True)


def test_a_timeout_after_the_worker_took_the_request_is_never_retried_and_answers_504():
    v = classify(Attempt(failure=Failure.TIMEOUT, accepted=True), 1, 3)
    assert (v.action, v.status, v.counts_against_worker) == (Action.GATEWAY_TIMEOUT, 504, True)
    assert v.code == "worker_timeout" and v.message


def test_a_connect_timeout_is_retried_elsewhere():
    v = classify(Attempt(failure=Failure.TIMEOUT, accepted=False), 1, 3)
    assert (v.action, v.counts_against_worker) == (Action.RETRY, True)


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_statuses_are_retried_without_blaming_the_worker(status):
    v = classify(Attempt(status=status, body=b"busy"), 1, 3)
    assert (v.action, v.counts_against_worker) == (Action.RETRY, False)


def test_429_is_retried_after_its_retry_after_and_a_long_one_goes_back_to_the_client():
    short = classify(Attempt(status=429, body=b"{}", retry_after="1"), 1, 3)
    assert (short.action, short.delay_s, short.counts_against_worker) == (Action.RETRY, 1.0, False)
    assert classify(Attempt(status=429, body=b"{}"), 1, 3).delay_s == 0.0
    long = classify(Attempt(status=429, body=b"{}", retry_after=str(RETRY_AFTER_CAP_S + 55)), 1, 3)
    assert long.action is Action.PASS_THROUGH


def test_a_500_is_retried_once_and_a_second_500_goes_to_the_client():
    first = classify(Attempt(status=500, body=ENGINE_CRASHED), 1, 3)
    assert (first.action, first.counts_against_worker) == (Action.RETRY, False)
    second = classify(Attempt(status=500, body=ENGINE_CRASHED), 2, 3, statuses_seen=[500])
    assert (second.action, second.counts_against_worker) == (Action.PASS_THROUGH, False)
    after_a_503 = classify(Attempt(status=500, body=ENGINE_CRASHED), 2, 3, statuses_seen=[503])
    assert after_a_503.action is Action.RETRY


@pytest.mark.parametrize("body", [UNREACHABLE_IMAGE, IMAGE_TIMEOUT, UNDECODABLE_IMAGE])
def test_a_500_about_the_requests_own_media_is_a_400_not_retried_and_not_blamed(body):
    v = classify(Attempt(status=500, body=body), 1, 3)
    assert (v.action, v.status, v.counts_against_worker) == (Action.CLIENT_ERROR, 400, False)
    assert v.code == "invalid_media" and "media" in (v.message or "")


def test_a_500_saying_the_context_is_too_long_is_a_400():
    v = classify(Attempt(status=500, body=CONTEXT_TOO_LONG), 1, 3)
    assert (v.action, v.status, v.code, v.counts_against_worker) == (
        Action.CLIENT_ERROR, 400, "context_length_exceeded", False)


def test_engine_4xx_in_openai_shape_passes_through_and_other_4xx_are_reshaped():
    fetch_404 = _openai("Failed to fetch media from URL: HTTP 404 error", "UnprocessableEntityError", 422)
    v = classify(Attempt(status=422, body=fetch_404), 1, 3)
    assert (v.action, v.counts_against_worker) == (Action.PASS_THROUGH, False)
    plain = classify(Attempt(status=400, body=b"bad json"), 1, 3)
    assert (plain.action, plain.status, plain.message) == (Action.CLIENT_ERROR, 400, "bad json")


def test_with_no_attempts_left_the_last_answer_goes_back_or_503():
    v = classify(Attempt(status=503, body=b"busy"), attempts_made=3, max_attempts=3)
    assert v.action is Action.PASS_THROUGH
    assert classify(Attempt(failure=Failure.CONNECT), 3, 3).action is Action.UNAVAILABLE
    assert classify(Attempt(failure=Failure.CONNECT), 3, 3).counts_against_worker


def test_other_5xx_pass_through_unblamed():
    v = classify(Attempt(status=501, body=_openai("not implemented", code=501)), 1, 3)
    assert (v.action, v.counts_against_worker) == (Action.PASS_THROUGH, False)
