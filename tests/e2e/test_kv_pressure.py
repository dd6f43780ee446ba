"""kv_cost through a real proxy to real sim workers: under KV pressure hot prefixes stay and cold prompts move;
a prompt longer than every worker's max_model_len gets the engine's own 400.

Two cpu-tiny sim workers with a 4096-token KV cache each, in real time. A long shared system
prompt becomes hot on one worker; while that worker's cache is loaded with its streams, cold long
prompts sent one at a time go to the other worker (they would wait for KV there and push the hot
prefix out), and the hot requests keep going to their owner.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(120)

HOT_SYSTEM = ("You are the assistant of a bicycle repair shop. Quote the workshop manual section for every "
              "answer and never invent part numbers. ") * 40


def hot_body(i: int, max_tokens: int) -> dict:
    return {"model": "m1", "max_tokens": max_tokens, "stream": True, "messages": [
        {"role": "system", "content": HOT_SYSTEM}, {"role": "user", "content": f"Question {i}: a squeaky brake?"}]}


def cold_body(i: int) -> dict:
    rng = random.Random(i)
    text = " ".join(rng.choice(("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf")) + str(rng.randrange(99))
                    for _ in range(900))
    return {"model": "m1", "max_tokens": 16, "stream": True, "messages": [
        {"role": "user", "content": f"Summarise document {i}: {text}"}]}


def test_a_hot_prefix_keeps_its_worker_under_pressure_while_cold_prompts_go_elsewhere(fleet):
    fleet.start_proxy("--policy", "kv_cost", "--log-level", "debug")  # each decision's predicted times land in the proxy's log
    fleet.start_sims(2, time_scale=1, kv_capacity_tokens=4096)
    owners = set()
    for i in range(3):  # sequential: the prefix becomes hot on one worker, and the proxy learns how long requests
        # run there (how soon KV frees: a cold prompt that does not fit beside the streams below waits that long)
        resp = fleet.http.post(fleet.url + "/v1/chat/completions", json=hot_body(i, 64))
        assert resp.status_code == 200
        owners.add(resp.headers["x-kvroute-worker"])
    assert len(owners) == 1, owners
    (owner,) = owners

    async def under_pressure() -> tuple[list[httpx.Response], list[httpx.Response]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            url = fleet.url + "/v1/chat/completions"
            # 3 long streams (not 6 shorter ones): the same KV pressure, and they outlast the cold prompts below
            # even when two loaded cores slow this client down
            hot = [asyncio.create_task(client.post(url, json=hot_body(10 + i, 600))) for i in range(3)]

            def loaded() -> bool:
                report = fleet.worker(owner).get("last_report") or {}
                return report.get("kv_cache_usage", 0.0) >= 0.4
            await asyncio.to_thread(wait_until, loaded, 20, 0.02, f"{owner} under KV pressure")
            # one at a time while the owner's streams run: each cold prompt (~3000 tokens) alone
            # would not fit in the owner's free KV beside them, and would push its hot prefix out
            # (a cold prompt counts only when sent while the owner's streams still ran: on a slow box they may
            # end before all three were sent, and then the owner is rightly free again)
            cold, more_hot = [], []
            for i in range(3):
                if all(t.done() for t in hot):
                    break
                cold.append(await client.post(url, json=cold_body(i)))
                more_hot.append(await client.post(url, json=hot_body(20 + i, 16)))
            assert cold, "the owner's streams ended before the first cold prompt came"
            return list(await asyncio.gather(*hot)) + more_hot, cold

    hot, cold = asyncio.run(under_pressure())
    assert all(r.status_code == 200 for r in hot + cold)
    hot_workers = [r.headers["x-kvroute-worker"] for r in hot]
    cold_workers = [r.headers["x-kvroute-worker"] for r in cold]
    assert hot_workers == [owner] * len(hot), (hot_workers, fleet.workers())
    assert owner not in cold_workers, (cold_workers, fleet.workers())


def test_without_a_tokenizer_a_prompt_too_long_for_the_engine_gets_the_engines_own_400(fleet):
    """The proxy never refuses on its estimate: the engine, which knows the count, answers, and its error
    reaches the client as the engine wrote it (with a tokenizer the proxy refuses first:
    tests/e2e/test_tokenizer_handover.py)."""
    fleet.start_proxy()
    fleet.start_sims(1, kv_capacity_tokens=4096)  # the sim caps max_model_len at its cache: 4096
    resp = fleet.chat("many words " * 4000)
    assert resp.status_code == 400, resp.text
    assert resp.headers["x-kvroute-worker"] == "sim-0"  # it went to the engine
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "maximum context length is 4096 tokens" in error["message"]
    assert fleet.chat("a short question").status_code == 200
