"""Chaos in CI (issue 12): `kvroute bench chaos` at a small size, 3 sim workers behind a proxy on Redis.

Faults while requests flow: SIGKILLs with restarts (one with a slow start), a SIGSTOP stall, a worker
failing 20% of requests with 500, a redis-server restart. One healthy worker always remains, so every
request must succeed (mid-stream kills included: migration), none may hang, in-flight counts return to
0, and the proxy's fds and RSS stay flat from round to round.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.bench.test_bench_smoke import _processes_marked
from tests.support.procs import KVROUTE, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]

DEADLINE_S = 30.0
REQUESTS = 400  # per round
# fds of the proxy after a round, all workers ready again: pooled keep-alive connections to the workers
# come and go with restarts, so "flat" is a band, not one number; a leak of one fd per failed request
# (dozens per round) is far outside it
FD_BAND = 24
RSS_GROWTH_MB = 15.0


def test_requests_survive_kills_stalls_5xx_and_a_redis_restart_with_nothing_leaked(procs, tmp_path):
    assert shutil.which("redis-server"), "redis-server is not installed: run `make test` (it installs it)"
    bench = procs.start([*KVROUTE, "bench", "chaos", "--workers", "3", "--requests", str(REQUESTS), "--rounds", "2",
                         "--concurrency", "12", "--kills", "2", "--stalls", "1", "--stall-s", "2:4",
                         "--slow-start-s", "1", "--fail-rate", "0.2",
                         "--state", "redis", "--deadline-s", str(DEADLINE_S), "--seed", "12",
                         "--out-dir", str(tmp_path)],
                        name="bench-chaos", env={"KVROUTE_BENCH_MARK": str(tmp_path)})
    wait_until(lambda: not bench.alive(), 200, 0.2, "kvroute bench chaos to finish")
    data = json.loads(next(tmp_path.glob("*-chaos.json")).read_text())
    rounds = data["rounds"]
    assert len(rounds) == 2, bench.log()[-3000:]
    summary = [(r["round"], r["succeeded"], r["failures"], r["failure_examples"]) for r in rounds]
    for r in rounds:
        # the faults did happen, and mid-stream: kills hit workers holding requests
        assert r["faults"] == {"sigkill": 2, "sigstop": 1, "redis_restart": 1}, r["events"]
        assert any(e["in_flight"] > 0 for e in r["events"] if e["fault"] == "sigkill"), r["events"]
        assert r["streaming"] > 100 and r["retries"] > 0
        # nothing hung: every request ended before its deadline, and the proxy holds nothing afterwards
        assert r["failures"]["timeout"] == 0 and r["lat_max_s"] < DEADLINE_S, summary
        assert r["in_flight_after"] == 0, r
    assert all(r["succeeded"] == r["requests"] == REQUESTS for r in rounds), summary
    first, last = rounds[0], rounds[-1]
    assert abs(last["proxy_fds"] - first["proxy_fds"]) <= FD_BAND, [r["proxy_fds"] for r in rounds]
    assert last["proxy_rss_mb"] - first["proxy_rss_mb"] < RSS_GROWTH_MB, [r["proxy_rss_mb"] for r in rounds]
    assert bench.popen.returncode == 0, bench.log()[-3000:]
    wait_until(lambda: not _processes_marked(str(tmp_path)), 10, 0.2, "the bench's processes to be gone")
