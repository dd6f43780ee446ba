"""Workers on other machines register addresses the proxy can dial: never 0.0.0.0, never their loopback."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from tests.multihost.support import (
    MODEL,
    PROXY_PORT,
    WORKER_TOKEN,
    Load,
    proxy_config,
    start_proxy,
    start_sim,
    wait_ready,
    workers,
)
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)


def test_workers_bound_to_all_interfaces_register_the_address_the_proxy_reaches(net, tmp_path):
    a, b, c = net["a"], net["b"], net["c"]
    start_proxy(a, proxy_config(tmp_path))
    start_sim(b, [a], "b-0")  # 0.0.0.0, nothing advertised: the source address of B's route to A
    start_sim(c, [a], "c-0", "--advertise-url", f"http://{c.address}:8101/")  # told explicitly
    start_sim(a, [a], "a-0", port=8102)  # beside the proxy, dialling its network address
    a.kvroute("worker", "--engine", "sim", "--host", "0.0.0.0", "--port", "8103", "--served-model-name", MODEL,
              "--worker-id", "local-0", "--proxy-url", f"http://127.0.0.1:{PROXY_PORT}",
              "--proxy-token", WORKER_TOKEN, "--time-scale", "20", name="local-0")  # through loopback
    wait_ready(a, {"a-0", "local-0", "b-0", "c-0"})

    urls = {wid: w["url"] for wid, w in workers(a).items()}
    assert urls == {"a-0": f"http://{a.address}:8102", "local-0": "http://127.0.0.1:8103",
                    "b-0": f"http://{b.address}:8101", "c-0": f"http://{c.address}:8101"}
    everyone = {"a-0", "local-0", "b-0", "c-0"}
    with Load(a.url(PROXY_PORT), concurrency=8, max_tokens=16) as load:  # enough at once to spread
        wait_until(lambda: set(load.served_by()) == everyone, 30, 0.1, "every worker to serve through the proxy")
    assert not load.failures(), [o.error for o in load.failures()][:5]


def _nodes_add(host, proxy_url: str, url: str) -> dict:
    """POST /nodes/add from `host`, as `lmdeploy serve api_server --proxy-url` does (its own address)."""
    script = ("import httpx, json, sys; r = httpx.post(sys.argv[1] + '/nodes/add', json={'url': sys.argv[2], "
              "'status': {'models': []}}, headers={'Authorization': 'Bearer ' + sys.argv[3]}, timeout=10); "
              "print(json.dumps({'status': r.status_code, 'body': r.json()}))")
    done = host.run([sys.executable, "-c", script, proxy_url, url, WORKER_TOKEN])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_lmdeploy_announcing_0000_is_registered_at_the_callers_address(net, tmp_path):
    a, c = net["a"], net["c"]
    start_proxy(a, proxy_config(tmp_path))
    # An engine that knows nothing of kvroute, bound to every interface, announcing itself as LMDeploy does.
    c.kvroute("worker", "--engine", "sim", "--host", "0.0.0.0", "--port", "23333", "--served-model-name", MODEL,
              "--time-scale", "20", name="lmdeploy-like")
    wait_until(lambda: c.run([sys.executable, "-c", "import httpx; httpx.get('http://127.0.0.1:23333/health')"]
                             ).returncode == 0, 30, 0.2, "the engine on C to listen")
    answer = _nodes_add(c, a.url(PROXY_PORT), "http://0.0.0.0:23333")
    assert answer["status"] == 200, answer
    registered = workers(a)[answer["body"]["worker_id"]]
    assert registered["url"] == f"http://{c.address}:23333"
    r = httpx.post(f"{a.url(PROXY_PORT)}/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_the_advertised_url_is_never_an_unspecified_address():
    from backends.address import advertise_url

    assert advertise_url("http://10.0.0.7:9000/", "0.0.0.0", 8101, ["http://10.0.0.1:8000"]) == "http://10.0.0.7:9000"
    assert advertise_url(None, "10.0.0.2", 8101, ["http://10.0.0.1:8000"]) == "http://10.0.0.2:8101"
    assert advertise_url(None, "0.0.0.0", 8101, ["http://127.0.0.1:8000"]) == "http://127.0.0.1:8101"
    assert advertise_url(None, "::", 8101, []) == "http://127.0.0.1:8101"  # standalone: only this machine


def test_nodes_add_takes_the_callers_address_for_0000_or_refuses_when_it_has_none():
    from proxy.api.control import _from_caller

    assert _from_caller("http://0.0.0.0:23333", "10.203.0.4") == ("http://10.203.0.4:23333", False)
    assert _from_caller("http://[::]:23333", "fd00::4") == ("http://[fd00::4]:23333", False)
    assert _from_caller("http://10.0.0.9:23333", "10.203.0.4") == ("http://10.0.0.9:23333", False)
    assert _from_caller("http://0.0.0.0:23333", "")[1] is True  # unknown caller (a unix socket): 400
