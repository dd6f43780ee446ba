"""Two proxies on two machines share one Redis on a third: each routes what the other registered, one
cut off leaves the other serving the whole fleet, and its view heals when the link comes back."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.multihost.support import (
    MODEL,
    PROXY_PORT,
    Load,
    proxy_config,
    ready,
    start_proxy,
    start_sim,
    wait_ready,
)
from tests.support.procs import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(150)]

REDIS_PORT = 6379


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
        cut_at = time.monotonic()
        a.link_down()  # A keeps running, unreachable: d-0's reports to A stop, it moves to B
        wait_until(lambda: ready(b) == {"d-0", "d-1"} and load.served_by()["d-0"] > 0
                   and any(o.worker == "d-0" and o.started > cut_at for o in load.snapshot()),
                   60, 0.1, "B serving d-0 again after A's cut")
        full_again = time.monotonic() - cut_at
        load.wait_served(20)
        healed_from = time.monotonic()
        a.link_up()
        wait_until(lambda: ready(a) == {"d-0", "d-1"}, 30, 0.1, "A's view to heal")
        healed = time.monotonic() - healed_from
        load.wait_served(10)

    failures = load.failures()
    print(f"\n[replicas] A cut: B routes d-0 again after {full_again:.2f} s; A's view healed {healed:.2f} s after "
          f"link-up; failed requests through B: {len(failures)} of {len(load.snapshot())}")
    assert not failures, [o.error for o in failures][:5]
    assert _ask(a, 20) == {"d-0", "d-1"}
