"""The engines' KV events at the proxy, across processes: every replica (state: redis) holds the same view, a
restarted worker starts from an empty one, and a skipped batch is answered with a request for a snapshot."""

from __future__ import annotations

import signal
import time

import pytest

from proxy.kvevents import KvEventBatch, pack_hashes
from tests.sim.conftest import read_state
from tests.sim.test_kv_events import kv_view
from tests.support.fleet import Fleet
from tests.support.procs import wait_http_ok, wait_until

pytestmark = [pytest.mark.timeout(120)]


def _long_prompts(fleet: Fleet, tag: str, n: int) -> None:
    for i in range(n):
        resp = fleet.chat(" ".join(f"{tag}{i}w{j}" for j in range(150)), max_tokens=2)
        assert resp.status_code == 200, resp.text


@pytest.mark.redis
def test_every_replica_sees_the_engines_cache_as_it_is(procs, tmp_path, redis_url):
    a, b = Fleet(procs, tmp_path), Fleet(procs, tmp_path)
    a.start_proxy("--state", redis_url)
    b.start_proxy("--state", redis_url)
    (sim,) = a.start_sims(1, kv_capacity_tokens=16 * 64, extra=("--block-size", "16"))  # reports to `a` only
    _long_prompts(b, "r", 5)  # served through the other replica: the cache fills and evicts

    def both_equal_to_the_engine() -> bool:
        cached = read_state(sim.url)["cached_blocks"]
        views = [kv_view(fleet.url, sim.worker_id) for fleet in (a, b)]
        return all(v.get("state") == "exact" and v.get("blocks") == cached for v in views)

    wait_until(both_equal_to_the_engine, 15, 0.1, "both replicas' views to equal the sim's cache")
    assert read_state(sim.url)["cached_blocks"] > 0


def test_a_restarted_worker_starts_from_an_empty_view(procs, tmp_path):
    fleet = Fleet(procs, tmp_path)
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1, extra=("--block-size", "16"))
    _long_prompts(fleet, "before", 2)
    wait_until(lambda: kv_view(fleet.url, "sim-0").get("blocks", 0) > 0, 10, 0.1, "blocks at the proxy")
    sim.proc.signal(signal.SIGKILL)
    sim.proc.popen.wait(10)
    port = int(sim.url.rsplit(":", 1)[1])
    procs.kvroute("worker", "--engine", "sim", "--port", str(port), "--served-model-name", "m1", "--time-scale", "20",
                  "--block-size", "16", "--proxy-url", fleet.url, "--worker-id", "sim-0", name="sim-0-again")
    wait_http_ok(sim.url + "/health")
    # the new boot's engine holds nothing: neither does the proxy's view of it, though the old one held blocks
    wait_until(lambda: kv_view(fleet.url, "sim-0") == {"blocks": 0.0, "state": "exact", "resyncs": 1.0}, 15, 0.1,
               "the restarted worker's empty, exact view")


def test_a_skipped_batch_is_answered_with_a_request_for_a_snapshot(procs, tmp_path):
    fleet = Fleet(procs, tmp_path)
    fleet.start_proxy()
    fleet.register("w1", "http://127.0.0.1:9")
    scheme = {"block_size": 16, "hash_algo": "sha256_cbor", "hash_seed": "vllm-none-hash"}
    seq = 0

    def report(batch: KvEventBatch) -> dict:
        nonlocal seq
        seq += 1
        resp = fleet.http.post(f"{fleet.url}/workers/w1/report", headers={
            "Authorization": f"Bearer {fleet.secrets['w1']}"}, json={
            "worker_id": "w1", "url": "http://127.0.0.1:9", "models": ["m1"], "engine": "sim", "state": "ready",
            "kv_cache_usage": 0.1, "kv_capacity_tokens": 20000, "num_running": 0, "num_waiting": 0,
            "seq": seq, "sent_at": time.time(), "kv_events": batch.model_dump(exclude_none=True)})
        assert resp.status_code == 200, resp.text
        return resp.json()

    assert report(KvEventBatch(seq=1, snapshot=True, stored=pack_hashes([1, 2]), **scheme)).get("kv_resync") is None
    assert report(KvEventBatch(seq=2, stored=pack_hashes([3]))).get("kv_resync") is None
    assert report(KvEventBatch(seq=4, stored=pack_hashes([5]))) == {  # batch 3 was lost on the way
        "ok": True, "report_interval_s": 0.05, "kv_resync": True}
    assert kv_view(fleet.url, "w1") == {"blocks": 0.0, "state": "awaiting", "resyncs": 1.0}
    assert report(KvEventBatch(seq=5, snapshot=True, stored=pack_hashes([1, 2, 3, 4, 5]), **scheme)).get(
        "kv_resync") is None
    assert kv_view(fleet.url, "w1") == {"blocks": 5.0, "state": "exact", "resyncs": 1.0}
