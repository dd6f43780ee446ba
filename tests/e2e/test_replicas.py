"""Replicas that heal (state: redis): two `kvroute proxy` processes on one real redis-server.

A restarted worker is ready on both at once (boot ids), a removal sticks (tombstones), and a worker
whose proxy dies reports to another (`--proxy-url A,B`), so the surviving replica keeps every live worker.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from proxy.protocol import WorkerRegistration
from proxy.workers.redis_mirror import RedisState
from proxy.workers.registry import Registry
from tests.support.fleet import Fleet
from tests.support.procs import free_port, wait_http_ok, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


def _replica(procs, tmp_path, redis_url: str, *args: str) -> Fleet:
    fleet = Fleet(procs, tmp_path)
    fleet.start_proxy("--state", redis_url, *args)
    return fleet


def _start_sim(procs, worker_id: str, port: int, proxy_urls: list[str]):
    proc = procs.kvroute("worker", "--engine", "sim", "--port", str(port), "--served-model-name", "m1",
                         "--time-scale", "20", "--drain-grace-s", "1", "--worker-id", worker_id,
                         *[a for url in proxy_urls for a in ("--proxy-url", url)], name=worker_id)
    wait_http_ok(f"http://127.0.0.1:{port}/health")
    return proc


def _ready(fleet: Fleet) -> dict[str, dict]:
    return {w["worker_id"]: w for w in fleet.workers() if w["state"] == "ready"}


def test_a_worker_restarted_with_its_id_is_ready_on_both_replicas_within_2s(procs, tmp_path, redis_url):
    a, b = _replica(procs, tmp_path, redis_url), _replica(procs, tmp_path, redis_url)
    port = free_port()
    old = _start_sim(procs, "w0", port, [a.url])
    # long enough that the old boot's seq is far above what the new boot reaches in 2 s
    b.wait_workers(lambda ws: ws and ws[0]["state"] == "ready" and ws[0]["last_report"]["seq"] > 20,
                   what="reports through redis")
    old_boot = b.worker("w0")["last_report"]["boot_id"]
    old.signal(signal.SIGKILL)
    old.popen.wait(10)
    _start_sim(procs, "w0", port, [a.url])
    a.wait_workers(lambda ws: ws and ws[0]["state"] == "ready" and ws[0]["last_report"]["boot_id"] != old_boot,
                   what="the new boot ready on its own proxy")
    started = time.monotonic()
    b.wait_workers(lambda ws: ws and ws[0]["state"] == "ready" and ws[0]["last_report"]["boot_id"] != old_boot,
                   timeout=2.0, what="the new boot ready on the other replica")
    assert time.monotonic() - started < 2.0
    assert b.chat().status_code == 200


def test_a_worker_removed_on_one_replica_is_gone_on_the_other_and_stays_gone(procs, tmp_path, redis_url):
    a, b = _replica(procs, tmp_path, redis_url), _replica(procs, tmp_path, redis_url)
    ghost = f"http://127.0.0.1:{free_port()}"  # a worker that died without deregistering
    a.register("ghost", ghost)
    b.wait_workers(lambda ws: [w["worker_id"] for w in ws] == ["ghost"], what="ghost via redis")
    assert httpx.delete(f"{a.url}/workers/ghost", headers=a.admin()).status_code == 200
    wait_until(lambda: b.workers() == [], 2.0, what="the removal on the other replica")
    deadline = time.monotonic() + 5.0  # > 2 resyncs (RESYNC_INTERVAL_S) of each replica
    while time.monotonic() < deadline:
        assert a.workers() == [] and b.workers() == []
        time.sleep(0.2)


async def test_a_replica_that_missed_a_removal_drops_the_worker_at_resync_instead_of_restoring_it(redis_url):
    a, b = RedisState(Registry(), redis_url), RedisState(Registry(), redis_url)
    await a.start()
    await b.start()
    try:
        a.registry.register(WorkerRegistration(worker_id="w1", url="http://127.0.0.1:9", models=["m1"]))
        wait_for = time.monotonic() + 5
        while b.registry.get("w1") is None and time.monotonic() < wait_for:
            await _tick()
        assert b.registry.get("w1") is not None
        a.registry.remove("w1")
        while await a._redis.hexists("kvroute:workers", "w1") or b.registry.get("w1") is not None:
            await _tick()
        # b missed the removal event (as if pub/sub dropped it): it still holds the worker, then resyncs
        b._applying = True  # no await in between: b's own mirror does not see this
        b.registry.register(WorkerRegistration(worker_id="w1", url="http://127.0.0.1:9", models=["m1"]))
        b._applying = False
        await b.resync()
        assert b.registry.get("w1") is None
        assert not await a._redis.hexists("kvroute:workers", "w1")
        await a.resync()
        assert a.registry.get("w1") is None
    finally:
        await a.stop()
        await b.stop()


async def _tick() -> None:
    import asyncio

    await asyncio.sleep(0.05)


def test_after_a_replica_is_killed_the_other_routes_to_every_live_worker_within_3s(procs, tmp_path, redis_url):
    a = _replica(procs, tmp_path, redis_url)
    b = _replica(procs, tmp_path, redis_url, "--policy", "round_robin")
    ids = {"via-a-0": [a.url, b.url], "via-a-1": [a.url, b.url], "via-b": [b.url, a.url]}
    for worker_id, urls in ids.items():
        _start_sim(procs, worker_id, free_port(), urls)
    b.wait_workers(lambda ws: {w["worker_id"] for w in ws if w["state"] == "ready"} == set(ids),
                   what="all workers ready on b")
    proxy_a = next(p for p in procs.procs if p.name == "proxy")
    proxy_a.signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: set(_ready(b)) == set(ids), 3.0, what="every live worker ready on b after a died")
    served = {b.chat(f"q{i}").headers["x-kvroute-worker"] for i in range(9)}
    assert served == set(ids) and time.monotonic() - killed < 3.0 + 5.0
    # and keeps them: the workers of a now report to b, every one ready through 8 more reports of each (a worker
    # that registers anew shows no report until its first)
    seen: dict[str, set[int]] = {wid: set() for wid in ids}
    deadline = time.monotonic() + 15.0
    while True:
        ready = _ready(b)
        assert set(ready) == set(ids), ready
        for wid, w in ready.items():
            if w.get("last_report"):
                seen[wid].add(w["last_report"]["seq"])
        if all(len(seqs) > 8 for seqs in seen.values()):
            break
        assert time.monotonic() < deadline, f"fewer than 8 more reports of each worker on b in 15 s: {ready}"
        time.sleep(0.05)
    assert all(w["reading_age_s"] < 1.0 for w in ready.values()), ready


def test_every_replica_sees_every_workers_reports_within_one_report_interval(procs, tmp_path, redis_url):
    a, b = _replica(procs, tmp_path, redis_url), _replica(procs, tmp_path, redis_url)
    own = {"to-a": a, "to-b": b}
    for worker_id, proxy in own.items():
        _start_sim(procs, worker_id, free_port(), [proxy.url])
    for proxy in (a, b):
        proxy.wait_workers(lambda ws: {w["worker_id"] for w in ws if w["state"] == "ready"} == set(own),
                           what="both workers ready on each replica")
    lags: list[int] = []
    deadline = time.monotonic() + 3.0  # 12 report intervals
    while time.monotonic() < deadline:
        for worker_id, proxy in own.items():
            other = b if proxy is a else a
            seq_own = proxy.worker(worker_id)["last_report"]["seq"]
            seq_other = other.worker(worker_id)["last_report"]["seq"]  # read after: it had longer
            lags.append(seq_own - seq_other)
        time.sleep(0.05)
    # the replica a worker does not talk to is never more than one report behind the one it does
    assert len(lags) > 20 and max(lags) <= 1, lags


def test_a_worker_whose_proxy_died_is_scraped_and_routed_normally_by_the_other_replica(procs, tmp_path, redis_url):
    # Issue 33, item 11: each worker knows only its own proxy (the LMDeploy way: one --proxy-url). After one
    # proxy was SIGKILLed, the other kept the dead proxy's workers stale ("used when nothing ready is left")
    # although they answered; now it reads their engines' /metrics, as for a worker that never reported.
    a = _replica(procs, tmp_path, redis_url)
    b = _replica(procs, tmp_path, redis_url, "--policy", "round_robin")
    own = {"to-a-0": a, "to-a-1": a, "to-b": b}
    for worker_id, proxy in own.items():
        _start_sim(procs, worker_id, free_port(), [proxy.url])
    b.wait_workers(lambda ws: {w["worker_id"] for w in ws if w["state"] == "ready"} == set(own),
                   what="all workers ready on b")
    next(p for p in procs.procs if p.name == "proxy").signal(signal.SIGKILL)  # a, with no goodbye
    # they go stale (no report for STALE_AFTER_S), then b's scrapes make them ready again
    b.wait_workers(lambda ws: {w["worker_id"]: w["reading_source"] for w in ws if w["state"] == "ready"}
                   == {"to-a-0": "metrics", "to-a-1": "metrics", "to-b": "report"}, timeout=15,
                   what="a's workers ready on b, read from their /metrics")
    assert {b.chat(f"q{i}").headers["x-kvroute-worker"] for i in range(9)} == set(own)
    time.sleep(3.0)  # and they stay so: scraped at the non-reporting cadence, not stale again
    assert set(_ready(b)) == set(own)
    assert all(w["reading_age_s"] < 1.5 for w in _ready(b).values())
