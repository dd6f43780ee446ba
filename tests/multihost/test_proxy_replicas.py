"""Two proxies on two machines share one Redis on a third: each routes what the other registered, one
cut off leaves the other serving the whole fleet, and its view heals when the link comes back."""

from __future__ import annotations

import time

import httpx
import pytest

from proxy.protocol import STALE_AFTER_S
from tests.multihost.support import (
    MODEL,
    PROXY_PORT,
    Load,
    proxy_config,
    ready,
    start_proxy,
    start_sim,
    wait_ready,
    workers,
)
from tests.support.procs import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(150)]

REDIS_PORT = 6379


def _reported_since(proxy, worker_id: str, wall: float) -> bool:
    """Whether `proxy` holds a report from `worker_id` sent after `wall` (time.time(); one clock on this box)."""
    report = workers(proxy).get(worker_id, {}).get("last_report") or {}
    return float(report.get("sent_at") or 0) > wall


def _ask(proxy, n: int = 10) -> set[str]:
    served = set()
    with httpx.Client(timeout=10) as client:
        for i in range(n):
            r = client.post(f"{proxy.url(PROXY_PORT)}/v1/chat/completions",
                            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"{i}"}]})
            assert r.status_code == 200, r.text
            served.add(r.headers["x-kvroute-worker"])
    return served


def test_proxies_on_two_hosts_share_a_redis_on_a_third_through_a_partition(net, tmp_path):
    a, b, c, d = net["a"], net["b"], net["c"], net["d"]
    c.start(["redis-server", "--bind", "0.0.0.0", "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
             "--protected-mode", "no"], name="redis")
    state = f"redis://{c.address}:{REDIS_PORT}/0"
    start_proxy(a, proxy_config(tmp_path, "a.yaml", state=state), "proxy-a")
    start_proxy(b, proxy_config(tmp_path, "b.yaml", state=state), "proxy-b")

    # Registered through A (B second in its list): B routes it without ever having heard from it.
    start_sim(d, [a, b], "d-0")
    wait_ready(b, {"d-0"}, timeout=30)
    assert _ask(b) == {"d-0"}
    start_sim(d, [b, a], "d-1", port=8102)  # and one through B
    wait_ready(a, {"d-0", "d-1"}, timeout=30)

    with Load(b.url(PROXY_PORT), concurrency=4) as load:
        load.wait_served(20)
        cut_at, cut_wall = time.monotonic(), time.time()
        a.link_down()  # A keeps running, unreachable: d-0's reports to A stop, it moves to B
        # Past the stale window, B must still hear from d-0 (through B now) and route to it.
        not_ready_on_b: list[float] = []

        def moved() -> bool:
            if "d-0" not in ready(b):
                not_ready_on_b.append(time.monotonic())
            return _reported_since(b, "d-0", cut_wall + STALE_AFTER_S + 0.5) and ready(b) == {"d-0", "d-1"}

        wait_until(moved, 60, 0.1, "d-0 reporting to B after A's cut")
        moved_after = time.monotonic() - cut_at
        gap = not_ready_on_b[-1] - not_ready_on_b[0] if not_ready_on_b else 0.0
        routed_since = time.monotonic()
        wait_until(lambda: any(o.worker == "d-0" and o.started > routed_since for o in load.snapshot()), 30, 0.1,
                   "B to route to d-0 after the cut")
        load.wait_served(20)
        up_at, up_wall = time.monotonic(), time.time()
        a.link_up()
        # A's view heals from Redis: both ready, with reports sent after the link came back.
        wait_until(lambda: ready(a) == {"d-0", "d-1"} and _reported_since(a, "d-0", up_wall)
                   and _reported_since(a, "d-1", up_wall), 30, 0.1, "A's view to heal")
        healed = time.monotonic() - up_at
        load.wait_served(10)

    failures = load.failures()
    print(f"\n[replicas] A cut: d-0 reports through B {moved_after:.2f} s after the cut (out of B's routing set for "
          f"{gap:.2f} s meanwhile); A's view "
          f"healed {healed:.2f} s after link-up; failed requests through B: {len(failures)} of {len(load.snapshot())}")
    assert not failures, [o.error for o in failures][:5]
    assert _ask(a, 5)  # and A serves again
