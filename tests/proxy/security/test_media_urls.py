"""Media URLs a client may make an engine fetch: public addresses only, unless the operator lists more.

In process (the guard itself; names resolved by this machine's resolver: `localhost`, and a name that
cannot resolve), then against a real proxy and sim worker: refused URLs get OpenAI's 400 and never reach
an engine; allowed ones do.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from proxy.errors import ProxyError
from proxy.security.media_urls import MAX_HOSTS_PER_REQUEST, MediaUrlGuard, MediaUrlPolicy, media_urls

pytestmark = pytest.mark.timeout(120)


def chat(*urls: str, part_type: str = "image_url") -> dict:
    return {"model": "m1", "max_tokens": 2, "messages": [
        {"role": "user", "content": [*({"type": part_type, part_type: {"url": u}} for u in urls),
                                     {"type": "text", "text": "what is it?"}]}]}


def verdict(payload: dict, **policy: object) -> ProxyError | None:
    try:
        asyncio.run(MediaUrlGuard().check(payload, MediaUrlPolicy(**policy)))
    except ProxyError as exc:
        return exc
    return None


INSIDE = [
    "http://169.254.169.254/latest/meta-data/",   # the cloud's metadata service
    "http://127.0.0.1:8000/v1/models",            # the proxy, a worker, anything on the host
    "http://localhost/x.png",                     # a name for it
    "http://2130706433/x.png",                    # 127.0.0.1 in a form resolvers accept
    "http://0x7f.1/x.png",
    "http://[::1]/x.png",
    "http://[::ffff:10.0.0.5]/x.png",             # IPv4-mapped IPv6
    "https://10.1.2.3/x.png", "http://172.16.0.1/x.png", "http://192.168.1.1/x.png",  # private networks
    "http://100.64.0.1/x.png",                    # carrier-grade NAT
    "http://[fd00::1]/x.png",                     # IPv6 unique local
    "http://0.0.0.0/x.png",
    "http://user:pw@169.254.169.254/x.png",       # credentials do not hide the host
]


@pytest.mark.parametrize("url", INSIDE)
def test_a_media_url_inside_the_fleets_networks_is_refused_with_a_400_naming_the_part(url):
    err = verdict(chat("data:image/png;base64,AAAA", url))
    assert err is not None and err.status == 400 and err.code == "media_url_refused"
    assert err.param == "messages[0].content[1]"
    assert "allowed_networks" in err.message


@pytest.mark.parametrize("url", ["http://93.184.215.14/cat.png", "https://[2606:4700::1111]/a.jpg",
                                 "data:image/png;base64,AAAA"])
def test_public_addresses_and_data_urls_pass(url):
    assert verdict(chat(url)) is None
    assert verdict(chat(url, part_type="video_url")) is None


def test_the_operator_may_allow_a_private_network_and_file_urls():
    assert verdict(chat("http://10.1.2.3/x.png"), allowed_networks=["10.0.0.0/8"]) is None
    assert verdict(chat("http://10.1.2.3/x.png"), allowed_networks=["192.168.0.0/16"]) is not None
    assert verdict(chat("file:///etc/passwd")).code == "media_url_refused"
    assert verdict(chat("file:///data/img.png"), allow_file_urls=True) is None
    with pytest.raises(ValueError):
        MediaUrlPolicy(allowed_networks=["ten"])


@pytest.mark.parametrize("url", ["ftp://93.184.215.14/x.png", "gopher://93.184.215.14/", "http:///x.png",
                                 "http://no-such-host.invalid/x.png"])
def test_other_schemes_hostless_and_unresolvable_urls_are_refused(url):
    err = verdict(chat(url))
    assert err is not None and err.status == 400 and err.code == "media_url_refused"


def test_a_request_naming_too_many_hosts_is_refused_before_resolving_them():
    urls = [f"http://h{i}.example.invalid/x.png" for i in range(MAX_HOSTS_PER_REQUEST + 1)]
    err = verdict(chat(*urls))
    assert err is not None and f"at most {MAX_HOSTS_PER_REQUEST} hosts" in err.message


def test_media_urls_reads_url_parts_and_string_parts_and_skips_the_rest():
    payload = {"messages": [
        {"role": "system", "content": "text only"},
        {"role": "user", "content": [{"type": "text", "text": "http://not-media/"},
                                     {"type": "image_url", "image_url": "http://a/1.png"},
                                     {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                     {"type": "video_url", "video_url": {"url": "https://b/v.mp4"}}]}]}
    assert list(media_urls(payload)) == [("messages[1].content[1]", "http://a/1.png"),
                                         ("messages[1].content[3]", "https://b/v.mp4")]


# --- against a real proxy and sim -----------------------------------------------------------------
def _received(sim_url: str) -> int:
    return httpx.get(sim_url + "/sim/state").json()["requests_received"]


def test_a_running_proxy_refuses_inside_urls_before_any_engine_and_serves_public_ones(fleet):
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1)
    url = fleet.url + "/v1/chat/completions"
    before = _received(sim.url)
    for bad in ("http://169.254.169.254/latest/meta-data/iam/", f"{sim.url}/sim/state", "file:///etc/passwd"):
        resp = httpx.post(url, json=chat(bad), timeout=30)
        body = resp.json()
        assert resp.status_code == 400 and set(body) == {"error"}, resp.text
        assert body["error"]["code"] == "media_url_refused" and body["error"]["type"] == "invalid_request_error"
    assert _received(sim.url) == before  # refused at the proxy: no engine was asked to fetch anything
    assert httpx.post(url, json=chat("http://93.184.215.14/cat.png"), timeout=30).status_code == 200
    assert _received(sim.url) == before + 1


def test_a_listed_network_lets_its_urls_through(fleet):
    fleet.start_proxy(config="proxy:\n  media_urls:\n    allowed_networks: [127.0.0.0/8]\n")
    (sim,) = fleet.start_sims(1)
    resp = httpx.post(fleet.url + "/v1/chat/completions", json=chat(f"{sim.url}/img.png"), timeout=30)
    assert resp.status_code == 200, resp.text


def test_a_name_that_does_not_resolve_is_looked_up_once_per_ttl_not_once_per_request(monkeypatch):
    import proxy.security.media_urls as module

    lookups: list[str] = []

    async def failing(host: str) -> list[str]:
        lookups.append(host)
        raise OSError("Name or service not known")

    monkeypatch.setattr(module, "resolve", failing)
    guard = MediaUrlGuard()

    async def twice() -> list[ProxyError]:
        errors = []
        for _ in range(2):
            with pytest.raises(ProxyError) as err:
                await guard.check(chat("http://gone.example.invalid/x.png"), MediaUrlPolicy())
            errors.append(err.value)
        return errors

    errors = asyncio.run(twice())
    assert [e.code for e in errors] == ["media_url_refused"] * 2 and lookups == ["gone.example.invalid"]
