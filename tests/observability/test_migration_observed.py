"""A stream that migrates is observed as one request: its access-log line names the worker that finished it and
counts the migration, and its trace has a route span for each pick, the migration's included.
"""

from __future__ import annotations

import json

import pytest

from tests.observability.test_tracing import Collector
from tests.proxy.dataplane.test_migration import MESSAGES, stream_and_kill
from tests.support.fleet import Fleet
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fleet(procs, tmp_path):
    f = Fleet(procs, tmp_path)
    yield f
    f.close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def test_a_migrated_stream_is_logged_under_its_last_worker_and_traced_with_both_picks(fleet, procs, collector,
                                                                                     monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # a span batch goes out after 100 ms, not 5 s
    fleet.start_proxy(config=f"proxy:\n  log_level: info\n  otlp_endpoint: {collector.url}\n")
    proxy = procs.procs[-1]
    sims = fleet.start_sims(2, time_scale=1.0)
    body = {"model": "m1", "stream": True, "max_tokens": 60, "ignore_eos": True, "messages": MESSAGES}
    chunks, events, victim = stream_and_kill(fleet, sims, "/v1/chat/completions", body, kill_after=10)
    assert events[-1] == b"[DONE]" and not any("error" in c for c in chunks)
    survivor = next(s.worker_id for s in sims if s.worker_id != victim)

    def access_lines() -> list[dict]:
        return [json.loads(line.split("kvroute.access: ", 1)[1]) for line in proxy.log().splitlines()
                if "kvroute.access: " in line]

    line = wait_until(lambda: next(iter(access_lines()), None), 10, 0.05, "the stream's access-log line")
    assert (line["worker"], line["migrations"], line["status"], line["stream"]) == (survivor, 1, 200, True)

    spans = wait_until(lambda: (lambda s: s if sum(x.name == "upstream" for x in s) == 2 else None)(
        list(collector.spans)), 20, 0.05, "both attempts' spans at the collector")
    routed = [{a.key: a.value.string_value for a in s.attributes}["kvroute.worker"] for s in spans
              if s.name == "route"]
    assert routed == [victim, survivor]
