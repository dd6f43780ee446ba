"""Disaggregated prefill and decode on real vLLM CPU engines, launched by `kvroute up` from a config with pools.

One prefill and one decode worker share ExampleConnector's folder (the connector finds KV by the prompt's tokens
and images there: both sides need the same one). They must start, register with their roles, and a prompt sent
first to the prefill worker (one token, do_remote_decode) and then to the decode worker must give the greedy
tokens the prefill worker gives when it runs the prompt whole, with the decode worker's KV coming through the
connector (vLLM's external prefix cache counters), for a text and an image prompt. Through kvroute's own P/D path
(`disagg.split: always`) the same holds: the proxy sends the prompt to the prefill worker for one token, then to the
decode worker, whose greedy tokens equal the aggregated answer's, and the answer names both workers.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.vllm.test_vllm_fleet import MODEL_DIR, png_data_url
from tests.fleet.support import Fleet
from tests.support.procs import KVROUTE, ProcessGroup, wait_until

pytestmark = [
    pytest.mark.vllm, pytest.mark.timeout(600),
]

ENGINE_KEY = "e2e-disagg-key"  # the operator's engine key: the test may call the engines directly
START_TIMEOUT_S = 420
LONG_TEXT = "Describe a harbour at dawn: the boats, the gulls, the fishermen mending their nets. " * 8


def config(kv_dir: str) -> str:
    return textwrap.dedent(f"""\
        proxy: {{drain_grace_s: 10, routing: {{disagg: {{split: always}}}}}}
        models:
          - name: tiny
            engine: vllm
            model: {MODEL_DIR}
            device: cpu
            startup_timeout_s: {START_TIMEOUT_S}
            engine_args: {{enforce-eager: true, kv-cache-memory-bytes: 8388608, max-model-len: 2048}}
            env: {{VLLM_API_KEY: {ENGINE_KEY}}}
            kv_transfer: {{connector: ExampleConnector, extra: {{shared_storage_path: {kv_dir}}}}}
            pools:
              - {{role: prefill, replicas: 1}}
              - {{role: decode, replicas: 1}}
        """)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("vllm-disagg")
    group = ProcessGroup(tmp)
    try:
        if not (MODEL_DIR / "config.json").exists():
            build = group.start([*KVROUTE, "make-tiny-model", str(MODEL_DIR)], name="make-tiny-model")
            assert build.popen.wait(180) == 0, build.log()
        fleet = Fleet(group, tmp, config(str(tmp / "kv")))
        fleet.wait_workers({"tiny-prefill-0", "tiny-decode-0"}, timeout=START_TIMEOUT_S)
        yield fleet
    except Exception:
        print(group.logs())
        raise
    finally:
        group.stop_all()


def engine(fleet: Fleet, worker_id: str) -> str:
    return fleet.workers()[worker_id]["url"]


def external_hits(url: str) -> float:
    """Prompt tokens the engine took from its KV connector (vLLM's cross-instance prefix cache)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total{"))


def complete(url: str, content, max_tokens: int, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": False, **extra}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180,
                      headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_both_pools_start_and_register_with_their_roles_and_connector(fleet):
    workers = fleet.workers()
    assert {wid: w["role"] for wid, w in workers.items()} == {"tiny-prefill-0": "prefill", "tiny-decode-0": "decode"}
    assert workers["tiny-prefill-0"]["labels"]["kv_role"] == "kv_producer"
    assert workers["tiny-decode-0"]["labels"]["kv_role"] == "kv_consumer"
    assert {w["labels"]["kv_connector"] for w in workers.values()} == {"ExampleConnector"}
    # the fleet manager counts a replica ready once its own check passes, a moment after it registered
    wait_until(lambda: [(p["role"], p["ready"]) for p in fleet.fleet()["models"][0]["pools"]]
               == [("prefill", 1), ("decode", 1)], 60, what="both pools ready in the fleet manager")


@pytest.mark.parametrize("kind", ["text", "image"])
def test_prefill_then_decode_gives_the_aggregated_greedy_tokens(fleet, kind):
    content = LONG_TEXT if kind == "text" else [
        {"type": "image_url", "image_url": {"url": png_data_url(96, 64, (200, 40, 40))}},
        {"type": "text", "text": "What is in this picture? Describe every detail of it, please. " * 10}]
    prefill, decode = engine(fleet, "tiny-prefill-0"), engine(fleet, "tiny-decode-0")
    aggregated = complete(prefill, content, 16)
    first = complete(prefill, content, 1, kv_transfer_params={"do_remote_decode": True})
    before = external_hits(decode)
    # ExampleConnector needs no params round trip (it answers none); the proxy passes on what the prefill gave
    answer = complete(decode, content, 16, kv_transfer_params=first.get("kv_transfer_params"))
    prompt = aggregated["usage"]["prompt_tokens"]
    assert prompt > 128, "the connector moves whole blocks of 128 tokens: the prompt must fill one"
    assert answer["usage"]["prompt_tokens"] == prompt and answer["usage"]["completion_tokens"] == 16
    assert answer["choices"][0]["token_ids"] == aggregated["choices"][0]["token_ids"]
    # the decode worker loaded the prompt's KV (whole blocks of 128 but the last token's) instead of computing it
    loaded = wait_until(lambda: (n := external_hits(decode) - before) > 0 and n, 15, what="the metrics to show it")
    assert loaded == (prompt - 1) // 128 * 128


@pytest.mark.parametrize("kind", ["text", "image"])
def test_greedy_answers_through_kvroutes_pd_path_equal_the_aggregated_ones(fleet, kind):
    # not the prompts above: the connector's folder must not already hold this prompt's KV
    content = "Tell me about a lighthouse keeper and the storms of one long winter. " * 8 if kind == "text" else [
        {"type": "text", "text": "Look closely at this picture and describe all you see in it, please. " * 10},
        {"type": "image_url", "image_url": {"url": png_data_url(96, 64, (40, 160, 60))}}]
    decode = engine(fleet, "tiny-decode-0")
    before = external_hits(decode)
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    resp = httpx.post(f"{fleet.url}/v1/chat/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvroute-worker"] == "tiny-prefill-0,tiny-decode-0"
    answer = resp.json()
    prompt = answer["usage"]["prompt_tokens"]
    assert prompt > 128 and answer["usage"]["completion_tokens"] == 16
    # the decode worker took the prompt's KV from what the proxy's prefill leg stored
    loaded = wait_until(lambda: (n := external_hits(decode) - before) > 0 and n, 15, what="the metrics to show it")
    assert loaded == (prompt - 1) // 128 * 128
    aggregated = complete(engine(fleet, "tiny-prefill-0"), content, 16)  # the whole prompt on one engine
    assert answer["choices"][0]["token_ids"] == aggregated["choices"][0]["token_ids"]
