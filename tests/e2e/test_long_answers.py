"""Non-streamed answers longer than the first-byte deadline (issue 12): `timeouts.total_s` governs them.

vLLM sends a non-streamed answer's headers only when the answer is complete, so a 10-minute answer passes
the default first_byte_s (300 s) twice over. Here the sim takes seconds and first_byte_s is a fraction of
that: the same proportion, in wall time a test can afford.
"""

from __future__ import annotations

import time

import pytest

from proxy import promtext

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 1000  # at time scale 1 the sim decodes a lone request at ~4 ms a token: ~4 s in all


def _retries(fleet) -> float:
    text = fleet.http.get(fleet.url + "/metrics").text
    return promtext.parse(text).total("kvroute:retries_total") or 0.0


def _served(sim) -> float:
    import httpx

    return promtext.parse(httpx.get(sim.url + "/metrics").text).total("vllm:request_success_total") or 0.0


def test_a_non_streamed_answer_far_past_first_byte_s_is_served_once_within_total_s(fleet):
    fleet.start_proxy(config="proxy:\n  timeouts:\n    first_byte_s: 0.5\n    total_s: 60\n")
    sims = fleet.start_sims(2, time_scale=1.0)
    started = time.monotonic()
    resp = fleet.chat("write a long essay", max_tokens=MAX_TOKENS, ignore_eos=True)
    took = time.monotonic() - started
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert took > 4 * 0.5  # the whole answer came long after first_byte_s: that deadline did not apply
    # run once: no retry, and the other worker never saw it
    assert _retries(fleet) == 0
    assert sorted(_served(s) for s in sims) == [0.0, 1.0]


def test_a_non_streamed_answer_past_total_s_gets_a_504_and_is_not_run_again(fleet):
    fleet.start_proxy(config="proxy:\n  timeouts:\n    first_byte_s: 30\n    total_s: 1.5\n")
    sims = fleet.start_sims(2, time_scale=1.0)
    started = time.monotonic()
    resp = fleet.chat("write a long essay", max_tokens=MAX_TOKENS, ignore_eos=True)
    took = time.monotonic() - started
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "worker_timeout"
    assert 1.5 <= took < 1.5 + 3.0
    assert resp.headers["x-kvroute-worker"] in {s.worker_id for s in sims}
    assert _retries(fleet) == 0  # it may still have been running: no second worker starts it again
    fleet.wait_workers(lambda ws: all(w["in_flight"] == 0 for w in ws), what="in-flight back to 0")
