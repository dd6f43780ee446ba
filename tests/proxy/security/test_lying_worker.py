"""A worker that lies about its load (issue 33, item 13): its reports lose weight where they disagree with
what the proxy measures, so it no longer takes most of the traffic. Unit checks of the trust factor, then
the attack with real processes: a slow sim whose reports say it is empty and has 1e12 tokens of KV.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from proxy.workers.loadview import EngineReading, WorkerLoad
from proxy.workers.report_trust import STRIKES, ReportTrust

pytestmark = pytest.mark.timeout(180)


def PEERS() -> int:  # noqa: N802 - stands for the registry's peer_capacity: the honest workers' KV size
    return 65536


def holding(requests: int, with_output: int, kv_tokens: int = 500) -> WorkerLoad:
    """A worker's load with `requests` sent 1 s ago and in flight, `with_output` of them producing output."""
    load = WorkerLoad(65536)
    dispatches = [load.start_request(kv_tokens, now=0.0, prefill_tokens=400) for _ in range(requests)]
    for d in dispatches[:with_output]:
        load.first_output(d)
    return load


def test_an_honest_reading_keeps_full_trust_and_is_seen_as_reported():
    load, trust = holding(6, 4), ReportTrust()
    for _ in range(10):
        honest = EngineReading(0.06, 4, 2, 65536)
        assert trust.weigh(honest, load, now=1.0, peer_capacity=PEERS) is honest
    assert trust.factor == 1.0


@pytest.mark.parametrize("lie", [EngineReading(0.0, 0, 0, 10**12), EngineReading(0.3, 0, 0, 65536),
                                 EngineReading(0.0, 6, 0, 65536)], ids=["empty-and-huge", "no-requests", "no-kv"])
def test_readings_that_contradict_the_requests_held_there_lose_trust(lie):
    load, trust = holding(6, 4), ReportTrust()
    trust.weigh(lie, load, now=1.0, peer_capacity=PEERS)
    assert trust.factor == 1.0  # one reading may lag a burst: no verdict yet
    for _ in range(8):
        seen = trust.weigh(lie, load, now=1.0, peer_capacity=PEERS)
    assert trust.factor == 0.0 and trust.disagreements == 9 >= STRIKES
    # routed on what the proxy holds there, sized like its honest peers, its requests queued
    assert seen.capacity_tokens == min(lie.capacity_tokens, PEERS())
    assert seen.kv_usage * seen.capacity_tokens >= 6 * 500 and seen.num_waiting >= 6 - lie.num_running


def test_kv_usage_that_never_moves_while_requests_come_and_go_loses_trust():
    load, trust = holding(4, 4), ReportTrust()
    frozen = EngineReading(0.25, 4, 0, 65536)
    for _ in range(12):
        finished = load.start_request(500, now=0.0)
        load.first_output(finished)
        load.finish_request(finished)  # a request came and went since the last reading
        trust.weigh(frozen, load, now=1.0, peer_capacity=PEERS)
        load.record_reading(frozen, 1.0, "report")
    assert trust.factor < 0.5


def test_trust_comes_back_once_readings_agree_and_nothing_held_tells_nothing():
    load, trust = holding(6, 4), ReportTrust()
    for _ in range(4):
        trust.weigh(EngineReading(0.0, 0, 0, 65536), load, now=1.0, peer_capacity=PEERS)
    low = trust.factor
    assert low < 1.0
    trust.weigh(EngineReading(0.0, 0, 0, 65536), WorkerLoad(65536), now=1.0, peer_capacity=PEERS)  # holds nothing: no evidence
    assert trust.factor == low
    for _ in range(40):
        trust.weigh(EngineReading(0.06, 4, 2, 65536), load, now=1.0, peer_capacity=PEERS)
    assert trust.factor == 1.0


# --- the attack, with real processes -------------------------------------------------------------------------

def _lie(fleet, worker_id: str, url: str, stop: threading.Event) -> None:
    """Report, 20 times a second as kvroute's workers may, an empty worker with 1e12 tokens of KV (within the
    protocol's bounds)."""
    secret = fleet.secrets[worker_id]
    seq = 0
    with httpx.Client(timeout=5.0) as client:
        while not stop.wait(0.05):
            seq += 1
            try:
                client.post(f"{fleet.url}/workers/{worker_id}/report", headers={"Authorization": f"Bearer {secret}"},
                            json={"worker_id": worker_id, "url": url, "models": ["m1"], "engine": "sim",
                                  "kv_cache_usage": 0.0, "kv_capacity_tokens": 10**12, "num_running": 0,
                                  "num_waiting": 0, "seq": seq, "sent_at": time.time()})
            except httpx.HTTPError:
                pass


def test_a_slow_worker_reporting_it_is_empty_with_1e12_tokens_no_longer_takes_most_of_the_traffic(fleet):
    # Issue 33, item 13: one lying worker (usage always 0, capacity 1e12) took 71-89% of the traffic. Here
    # it is also twice as slow as the two honest ones; believed, it took 56% of a 240-request load (57% with its
    # first third; docs/security.md), and would take that however slow it was.
    fleet.start_proxy()
    fleet.start_sims(2, time_scale=20.0, kv_capacity_tokens=16384)
    (slow,) = fleet.start_sims(1, register=False, time_scale=10.0, prefix="liar", kv_capacity_tokens=16384)
    fleet.register("liar", slow.url, capacity=10**12)
    stop = threading.Event()
    liar = threading.Thread(target=_lie, args=(fleet, "liar", slow.url, stop), daemon=True)
    liar.start()
    try:
        fleet.wait_workers(lambda ws: {w["worker_id"] for w in ws if w["state"] == "ready"} == {"sim-0", "sim-1",
                                                                                              "liar"})
        prompt = "word " * 1000
        with httpx.Client(timeout=60.0) as client, ThreadPoolExecutor(16) as pool:
            def ask(i: int) -> str:
                resp = client.post(fleet.url + "/v1/chat/completions", json={
                    "model": "m1", "max_tokens": 128, "messages": [{"role": "user", "content": f"q{i} {prompt}"}]})
                assert resp.status_code == 200, resp.text
                return resp.headers["x-kvroute-worker"]

            served = list(pool.map(ask, range(480)))
        # its first requests are believed (nothing contradicts a worker that holds nothing yet): the share
        # that matters is once it holds some
        late = served[160:]
        share = late.count("liar") / len(late)
        trust = next(w for w in fleet.workers() if w["worker_id"] == "liar")["report_trust"]
        print(f"liar share {share:.2f} (all: {served.count('liar') / len(served):.2f}), report_trust {trust}")
        # (25-27% with two busy loops beside it; at 4 reports/s and half the requests it ranged 27-59%: too few lies
        # landed while the load ran for trust to move)
        assert share < 0.5, f"the lying worker took {share:.0%} of the traffic"
        assert trust <= 0.25  # at least one full distrust step (x0.25) taken, not recovered
        honest = {w["worker_id"]: w["report_trust"] for w in fleet.workers() if w["worker_id"] != "liar"}
        assert honest == {"sim-0": 1.0, "sim-1": 1.0}
    finally:
        stop.set()
        liar.join(5)
