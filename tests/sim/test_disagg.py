"""The sim in every role of a disaggregated fleet, over vLLM's protocol, between real sim processes.

A prefill sim answers a `do_remote_decode` request with NIXL's kv_transfer_params and holds the blocks; a decode
sim given them pulls the blocks from it over HTTP, which frees them there; blocks nobody pulls come back when
their lease runs out; a decode sim that cannot load them answers as vLLM does. An encode sim runs only the
vision tower, keeps its output by image hash, and hands it to a sim whose request names it.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from proxy.pools import link
from tests.sim.conftest import png_data_url, read_metrics, read_state
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(90)

LONG_TEXT = " ".join(f"word{i} of a long shared document about harbours" for i in range(120))
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 2  # cpu-tiny: K and V x 4 layers x 2 KV heads x head_dim 64 x bf16


def kv(link_name: str = "tcp-25g", **extra: object) -> list[str]:
    return ["--kv-transfer", json.dumps({"connector": "NixlConnector", "kv_role": "kv_both", "link": link_name,
                                         "extra": extra.get("extra", {}), "options": extra.get("options", {}),
                                         })]


def chat(url: str, content, max_tokens: int = 8, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": "qwen3-vl-tiny", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}],
        **body})


def prefill(url: str, content) -> dict:
    """The proxy's first leg in vLLM's protocol: one token, not streamed, do_remote_decode."""
    resp = chat(url, content, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_prefill_answers_with_nixl_params_and_the_decode_worker_pulls_the_blocks(sim):
    _, p_url = sim("--role", "prefill", *kv(), name="prefill")
    _, d_url = sim("--role", "decode", *kv(), name="decode")
    first = prefill(p_url, LONG_TEXT)
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == int(p_url.rsplit(":", 1)[1])
    assert {"remote_engine_id", "remote_request_id", "tp_size", "remote_num_tokens", "transfer_mode"} <= set(params)
    prompt_tokens = first["usage"]["prompt_tokens"]
    blocks = -(-prompt_tokens // 128)
    assert len(params["remote_block_ids"][0]) == blocks
    assert params["remote_num_tokens"] == prompt_tokens
    assert read_state(p_url)["blocks_held_for_transfer"] == blocks  # held until pulled
    assert read_metrics(p_url)["kvroute:sim_kv_blocks_held_for_transfer"] == blocks

    answer = chat(d_url, LONG_TEXT, max_tokens=8, kv_transfer_params=params)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == prompt_tokens
    assert answer.json()["usage"]["completion_tokens"] == 8
    p_state, d_state = read_state(p_url), read_state(d_url)
    assert p_state["blocks_held_for_transfer"] == 0  # pulled, then freed
    assert p_state["kv_transfer"]["transfers_sent"] == 1
    moved = blocks * 128 * KV_BYTES_PER_TOKEN
    assert d_state["kv_transfer"]["bytes_received"] == moved == p_state["kv_transfer"]["bytes_sent"]
    tcp = link("tcp-25g")
    assert d_state["kv_transfer"]["transfer_seconds_received"] >= tcp.latency_s + moved / tcp.bytes_per_s
    # the decode worker computed one prompt token (the last, for its logits), not the prompt
    assert d_state["prefix_cache_queries"] == prompt_tokens and d_state["used_blocks"] == 0
    assert read_metrics(d_url)["kvroute:sim_kv_transfers_received_total"] == 1


def test_held_blocks_come_back_when_nobody_pulls_them_within_the_lease(sim):
    _, p_url = sim("--role", "prefill", "--time-scale", "10", *kv(extra={"kv_lease_duration": 5}), name="prefill")
    prefill(p_url, LONG_TEXT)
    assert read_state(p_url)["blocks_held_for_transfer"] > 0
    state = wait_until(lambda: (s := read_state(p_url))["blocks_held_for_transfer"] == 0 and s, 10,
                       what="the lease to run out")
    assert state["kv_transfer"]["lease_timeouts"] == 1 and state["used_blocks"] == 0
    assert read_metrics(p_url)["vllm:nixl_num_kv_expired_reqs_total"] == 1


def test_a_decode_worker_that_cannot_load_the_kv_fails_the_request_or_recomputes_it(sim):
    _, p_url = sim("--role", "prefill", "--time-scale", "10", *kv(extra={"kv_lease_duration": 2}), name="prefill")
    _, strict = sim("--role", "decode", *kv(), name="decode-fail")
    _, lenient = sim("--role", "decode", *kv(options={"kv_load_failure_policy": "recompute"}), name="decode-recompute")
    params = prefill(p_url, LONG_TEXT)["kv_transfer_params"]
    wait_until(lambda: read_state(p_url)["blocks_held_for_transfer"] == 0, 10, what="the lease to run out")
    failed = chat(strict, LONG_TEXT, kv_transfer_params=params)
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "Internal server error"
    assert read_state(strict)["kv_transfer"]["failed_pulls"] == 1
    recomputed = chat(lenient, LONG_TEXT, kv_transfer_params=params)
    assert recomputed.status_code == 200 and recomputed.json()["usage"]["completion_tokens"] == 8
    assert read_state(lenient)["used_blocks"] == 0 and read_state(strict)["used_blocks"] == 0


def test_a_decode_request_dropped_before_its_pull_frees_the_prefill_workers_blocks_at_once(sim):
    _, p_url = sim("--role", "prefill", *kv(), name="prefill")
    _, d_url = sim("--role", "decode", "--stall-after", "0", *kv(), name="decode-stalled")  # never schedules
    params = prefill(p_url, LONG_TEXT)["kv_transfer_params"]
    with httpx.Client(timeout=1.0) as client:
        try:
            client.post(f"{d_url}/v1/chat/completions", json={
                "model": "qwen3-vl-tiny", "max_tokens": 4, "kv_transfer_params": params,
                "messages": [{"role": "user", "content": LONG_TEXT}]})
        except httpx.TimeoutException:
            pass  # the client left: the sim aborts the request and tells the prefill worker
    state = wait_until(lambda: (s := read_state(p_url))["blocks_held_for_transfer"] == 0 and s, 10,
                       what="the prefill worker to free the blocks")
    assert state["kv_transfer"]["lease_timeouts"] == 0 and state["used_blocks"] == 0


def test_an_encode_worker_encodes_once_per_image_and_hands_its_output_over(sim):
    ec = ["--ec-transfer", json.dumps({"connector": "ECExampleConnector", "extra": {}, "options": {}})]
    _, e_url = sim("--role", "encode", *kv("rdma-400g"), *ec, name="encode")
    _, w_url = sim(*kv("rdma-400g"), *ec, name="both")
    image = {"type": "image_url", "image_url": {"url": png_data_url(256, 256)}}
    content = [image, {"type": "text", "text": "What is in the picture?"}]
    first = chat(e_url, content, max_tokens=1, stream=False)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["message"]["content"] == ""
    (mm_hash, item), = body["ec_transfer_params"].items()
    assert item["item_indices"] == [0] and item["num_tokens"] == 64  # 256x256 px: 8x8 merged patches
    assert (item["peer_host"], item["peer_port"]) == ("127.0.0.1", int(e_url.rsplit(":", 1)[1]))
    again = chat(e_url, content, max_tokens=1).json()
    assert again["ec_transfer_params"].keys() == {mm_hash}
    encoder = read_state(e_url)["encoder"]
    assert (encoder["cache_hits"], encoder["cache_misses"], encoder["media_tokens_encoded"]) == (1, 1, 64)

    answer = chat(w_url, content, max_tokens=4, ec_transfer_params=body["ec_transfer_params"])
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert read_state(w_url)["encoder"]["outputs_received"] == 1
    assert read_state(e_url)["encoder"]["bytes_sent"] == 64 * 2 * 128 * 3  # hidden 128 bf16, 3 feature levels


def test_a_decode_worker_keeps_the_lease_alive_while_the_request_waits_for_room(sim):
    lease = kv(extra={"kv_lease_duration": 1})  # one config for both pools, as kvroute up gives them
    _, p_url = sim("--role", "prefill", *lease, name="prefill")
    # room for one request at a time: 8 blocks of 128
    _, d_url = sim("--role", "decode", "--kv-capacity-tokens", "1024", *lease, name="decode")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hog = pool.submit(chat, d_url, "hog " * 400, 500)  # ~2 s of decoding, most of the cache
        wait_until(lambda: read_state(d_url)["num_running"] == 1, 10, what="the long request to run")
        text = "harbour " * 300
        params = prefill(p_url, text)["kv_transfer_params"]
        answer = pool.submit(chat, d_url, text, 4, kv_transfer_params=params)
        assert hog.result().status_code == 200
        assert answer.result().status_code == 200, answer.result().text  # waited past the 1 s lease: renewed
    state = read_state(p_url)
    assert state["kv_transfer"]["transfers_sent"] == 1 and state["kv_transfer"]["lease_timeouts"] == 0
    assert state["blocks_held_for_transfer"] == 0
