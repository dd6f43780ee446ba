"""`state: redis://`: two proxy replicas share one fleet view, and a restarted proxy has it back at once."""

from __future__ import annotations

import httpx
import pytest

from tests.support.fleet import Fleet

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


def test_two_replicas_share_workers_and_reports_and_a_restart_keeps_the_fleet(procs, tmp_path, redis_url):
    first = Fleet(procs, tmp_path)
    first.start_proxy("--state", redis_url)
    (sim,) = first.start_sims(1)  # registers and reports to the first replica only
    second = Fleet(procs, tmp_path)
    second.start_proxy("--state", redis_url)
    try:
        # the second replica has the worker from Redis, kept ready by reports relayed through Redis
        workers = second.wait_workers(lambda ws: [w["state"] for w in ws] == ["ready"], what="worker via redis")
        assert workers[0]["worker_id"] == sim.worker_id and workers[0]["reading_source"] == "report"
        seq = workers[0]["last_report"]["seq"]
        second.wait_workers(lambda ws: ws[0]["last_report"]["seq"] > seq + 4, what="reports keep arriving")
        resp = second.chat()
        assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == sim.worker_id

        # drain on one replica is seen by the other
        assert httpx.post(f"{second.url}/workers/{sim.worker_id}/drain", headers=second.admin()).status_code == 200
        first.wait_workers(lambda ws: ws[0]["state"] == "draining", what="drain via redis")

        # a replica started after everything happened gets the whole view at start-up
        third = Fleet(procs, tmp_path)
        third.start_proxy("--state", redis_url)
        assert [(w["worker_id"], w["state"]) for w in third.workers()] == [(sim.worker_id, "draining")]
        third.close()
    finally:
        first.close()
        second.close()


def test_losing_redis_keeps_the_last_known_view_and_serving(procs, tmp_path, redis_url):
    fleet = Fleet(procs, tmp_path)
    fleet.start_proxy("--state", redis_url)
    try:
        fleet.start_sims(1)
        redis_proc = next(p for p in procs.procs if p.name == "redis")
        redis_proc.stop()
        assert [fleet.chat(f"q{i}").status_code for i in range(5)] == [200] * 5
        assert fleet.workers()[0]["state"] == "ready"  # reports still arrive directly
    finally:
        fleet.close()
