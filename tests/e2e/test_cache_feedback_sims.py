"""Each answer's cached tokens at work, through a real proxy and sim workers: the routing accuracy a worker shows,
the approximate index following an engine that evicted, and a tokenizer that does not count as the engine does
found out from the answers and set aside, with no request refused on its wrong count.

The parts: proxy/routing/cache_feedback.py, proxy/dataplane/usage.py; unit tests: test_cache_feedback.py.
"""

from __future__ import annotations

import time

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.routing.cached_prefix import RECENT_S
from proxy.tokens.bundle import read_model_dir
from proxy.tokens.counter import PromptCounter
from tests.e2e.test_tokenizer_handover import TINY, content_of, hand_over
from tests.sim.test_kv_events import kv_view
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

SYSTEM = " ".join(f"clause{i} of the harbour rules" for i in range(120))  # ~900 tokens: many blocks of 16
# Qwen2.5's habit: a default system message when the conversation has none. The engine's template has none.
DEFAULT_SYSTEM = ("{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\nYou are a helpful "
                  "assistant.<|im_end|>\\n' -}}{%- endif -%}")


def prediction(fleet, worker_id: str) -> dict:
    return fleet.worker(worker_id)["cache_prediction"] or {}


def metric(fleet, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(fleet.http.get(fleet.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def with_system(fleet, question: str, **extra):
    return fleet.http.post(fleet.url + "/v1/chat/completions", json={
        "model": "m1", "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": question}], **extra})


def handed_over(fleet, sha256: str, workers: tuple[str, ...]) -> None:
    wait_until(lambda: all(hand_over(fleet, w, {"sha256": sha256}).json()["have"] for w in workers), 20, 0.2,
               "the proxy to hold the sims' tokenizer")


def test_an_exact_prediction_is_what_the_engine_reports_it_reused(fleet):
    fleet.start_proxy()
    fleet.start_sims(2, extra=("--tokenizer", str(TINY), "--block-size", "16"))
    handed_over(fleet, read_model_dir(TINY).sha256, ("sim-0", "sim-1"))
    first = with_system(fleet, "Where may ships anchor?")
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvroute-worker"]
    wait_until(lambda: kv_view(fleet.url, holder).get("blocks", 0) >= 50, 10, 0.1, "the engine's blocks at the proxy")
    time.sleep(RECENT_S)  # past the window in which a dispatch stands in for the engine's events
    stream = fleet.http.post(fleet.url + "/v1/chat/completions", json={
        "model": "m1", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And at night?"}]})
    assert stream.headers["x-kvroute-worker"] == holder  # the worker whose engine holds the prefix
    events = [line[6:] for line in stream.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    reused = orjson.loads(events[-2])["usage"]["prompt_tokens_details"]["cached_tokens"]  # as the engine sent it
    assert reused >= 800
    seen = prediction(fleet, holder)
    assert seen["last"] == {"predicted": reused, "actual": reused, "source": "exact"}
    assert seen["answers"] == 2 and seen["exact_answers"] == 2 and seen["mean_abs_error_tokens"] == 0
    assert metric(fleet, "kvroute:worker_cache_actual_tokens_total", worker=holder) == reused
    assert metric(fleet, "kvroute:worker_cache_answers_total", worker=holder, source="exact") == 2


def test_an_engine_without_events_that_evicted_is_no_longer_believed_to_hold_what_it_was_sent_before(fleet):
    fleet.start_proxy("--policy", "kv_cost")  # it predicts for a single worker too
    (sim,) = fleet.start_sims(1, extra=("--no-kv-events", "--block-size", "16"))
    older = " ".join(f"older{i} conversation" for i in range(200))
    for content in (older, SYSTEM, SYSTEM):  # the second time the engine reports a hit: it counts them
        assert fleet.chat(content, max_tokens=2).status_code == 200
    assert prediction(fleet, "sim-0")["last"]["actual"] > 0
    fleet.http.post(sim.url + "/reset_prefix_cache").raise_for_status()  # the engine forgets everything
    assert fleet.chat(SYSTEM, max_tokens=2).status_code == 200
    seen = prediction(fleet, "sim-0")
    assert seen["last"]["actual"] == 0 and seen["last"]["predicted"] > 500
    assert seen["index_corrections"]["evicted"] == 1
    # what it was sent before that is no longer believed either, and the prediction says so
    assert fleet.chat(older, max_tokens=2).status_code == 200
    assert prediction(fleet, "sim-0")["last"] == {"predicted": 0, "actual": 0, "source": "approximate"}


def test_a_tokenizer_the_engines_answers_contradict_is_set_aside_and_nothing_is_refused_on_its_count(fleet):
    fleet.start_proxy()
    sims = fleet.start_sims(2, kv_capacity_tokens=1024, extra=("--tokenizer", str(TINY), "--block-size", "16"))
    engines = read_model_dir(TINY)
    handed_over(fleet, engines.sha256, ("sim-0", "sim-1"))
    # the proxy is handed another template for the model (its hand-over API, as a misconfigured worker would)
    template = DEFAULT_SYSTEM + (TINY / "chat_template.jinja").read_text()
    other = read_model_dir(TINY, engine={"chat_template": template})
    assert hand_over(fleet, "sim-0", {"sha256": other.sha256, "bundle": other.to_wire()}).json()["have"]
    limit = fleet.workers()[0]["max_model_len"]
    near_limit = content_of(PromptCounter(engines), limit - 1)  # the engines serve it
    assert PromptCounter(other).count({"messages": [{"role": "user", "content": near_limit}]}, True).num_tokens > limit
    wrongly = fleet.chat(near_limit, max_tokens=None)
    assert wrongly.status_code == 400 and "x-kvroute-worker" not in wrongly.headers  # refused on the wrong count
    for i in range(8):
        answer = fleet.chat(f"question {i}: " + " ".join(f"word{j}" for j in range(40)), max_tokens=2)
        assert answer.status_code == 200, answer.text
    assert metric(fleet, "kvroute:tokenizer_mismatches_total", model="m1") == 1
    served = fleet.chat(near_limit, max_tokens=None)  # counted by estimate now: the engine decides
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == limit - 1
    answer = fleet.chat("Where may ships anchor?", max_tokens=2)
    assert answer.status_code == 200
    assert prediction(fleet, answer.headers["x-kvroute-worker"])["last"]["source"] == "approximate"
    log = fleet.proxy.log()
    assert log.count("does not count prompts of m1 as its engines do") == 1, log[-3000:]
    assert all(s.proc.alive() for s in sims)
