"""Mid-stream migration and stalled workers, against real sim workers behind a real proxy.

A worker SIGKILLed mid-stream hands the rest of the generation to another worker and the client sees one
stream; a worker frozen with SIGSTOP is found stalled and what it held moves elsewhere.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import orjson
import pytest

from backends.sim.tokens import count_text_tokens
from proxy.dataplane import migration
from proxy.request import CHAT, COMPLETIONS
from tests.e2e.test_forwarding import sse_events

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a long story."}]


def stream_and_kill(fleet, sims, path: str, body: dict, kill_after: int) -> tuple[list[dict], list[bytes], str]:
    """Stream `body`; after `kill_after` answer chunks, SIGKILL the worker serving it. (chunks, raw events,
    the killed worker's id)."""
    by_id = {s.worker_id: s for s in sims}
    received = b""
    with httpx.stream("POST", fleet.url + path, json=body, timeout=httpx.Timeout(30.0)) as resp:
        assert resp.status_code == 200
        victim = by_id[resp.headers["x-kvroute-worker"]]
        for piece in resp.iter_raw():
            received += piece
            if victim.proc.alive() and received.count(b"\n\n") >= kill_after:
                victim.proc.signal(signal.SIGKILL)
    events = sse_events(received)
    chunks = [orjson.loads(e) for e in events if e != b"[DONE]"]
    return chunks, events, victim.worker_id


def prompt_tokens(fleet, path: str, body: dict) -> int:
    """The prompt's tokens, as a sim counts them (the same request, unstreamed, one token)."""
    resp = fleet.http.post(fleet.url + path, json={**body, "stream": False, "max_tokens": 1, "stream_options": None})
    return resp.json()["usage"]["prompt_tokens"]


def migrations_metric(fleet, outcome: str) -> float:
    for line in fleet.http.get(fleet.url + "/metrics").text.splitlines():
        if line.startswith("kvroute:migrations_total{") and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_chat_stream_cut_by_sigkill_completes_on_another_worker_as_one_stream(fleet):
    fleet.start_proxy()
    sims = fleet.start_sims(2, time_scale=1.0)
    body = {"model": "m1", "stream": True, "max_tokens": 120, "ignore_eos": True, "messages": MESSAGES,
            "stream_options": {"include_usage": True}}
    chunks, events, victim = stream_and_kill(fleet, sims, "/v1/chat/completions", body, kill_after=20)

    assert events[-1] == b"[DONE]"
    assert not any("error" in c for c in chunks), chunks[-3:]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {"m1"}
    answer = [c for c in chunks if c["choices"] and "role" not in c["choices"][0]["delta"]]
    assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1  # one role chunk
    assert len(answer) == 120  # exactly max_tokens tokens under ignore_eos: none lost, none repeated
    text = "".join(c["choices"][0]["delta"]["content"] for c in answer)
    assert count_text_tokens(text) == 120  # the continuation went on from the text, not from a new message
    assert [c["choices"][0]["finish_reason"] for c in answer].count("length") == 1
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 120
    assert usage["prompt_tokens"] == prompt_tokens(fleet, "/v1/chat/completions", body)
    assert usage["total_tokens"] == usage["prompt_tokens"] + 120
    assert migrations_metric(fleet, "continued") == 1
    fleet.wait_workers(lambda ws: sum(w["in_flight"] for w in ws) == 0, what="in-flight back to 0")
    fleet.wait_workers(lambda ws: [w["state"] for w in ws if w["worker_id"] == victim] != ["ready"], timeout=10,
                       what="the killed worker out of the routing set")


def test_a_completions_stream_cut_by_sigkill_completes_on_another_worker(fleet):
    fleet.start_proxy()
    sims = fleet.start_sims(2, time_scale=1.0)
    body = {"model": "m1", "stream": True, "max_tokens": 100, "ignore_eos": True, "prompt": "Once upon a time",
            "stream_options": {"include_usage": True}}
    chunks, events, _ = stream_and_kill(fleet, sims, "/v1/completions", body, kill_after=15)

    assert events[-1] == b"[DONE]"
    assert not any("error" in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    answer = [c for c in chunks if c["choices"]]
    assert len(answer) == 100
    assert chunks[-1]["usage"]["completion_tokens"] == 100
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_tokens(fleet, "/v1/completions", body)


def test_a_stream_that_cannot_be_continued_ends_with_the_error_event(fleet):
    fleet.start_proxy()
    sims = fleet.start_sims(2, time_scale=1.0)
    # logprobs: a continuation could not give the same (the sim ignores them, so the stream itself is fine)
    body = {"model": "m1", "stream": True, "max_tokens": 400, "messages": MESSAGES, "logprobs": True}
    chunks, events, _ = stream_and_kill(fleet, sims, "/v1/chat/completions", body, kill_after=10)
    assert events[-1] == b"[DONE]"
    assert chunks[-1]["error"]["code"] == "worker_failed"
    assert len(chunks) < 400
    assert migrations_metric(fleet, "continued") == 0


def test_with_migrations_0_a_cut_stream_ends_with_the_error_event(fleet):
    fleet.start_proxy(config="proxy:\n  migrations: 0\n")
    sims = fleet.start_sims(2, time_scale=1.0)
    body = {"model": "m1", "stream": True, "max_tokens": 400, "messages": MESSAGES}
    chunks, events, _ = stream_and_kill(fleet, sims, "/v1/chat/completions", body, kill_after=10)
    assert events[-1] == b"[DONE]"
    assert chunks[-1]["error"]["code"] == "worker_failed"
    assert "connection_lost" in chunks[-1]["error"]["message"]


async def test_a_worker_frozen_with_sigstop_costs_no_client_a_timeout(fleet):
    fleet.start_proxy()
    sims = fleet.start_sims(2, time_scale=1.0)
    by_id = {s.worker_id: s for s in sims}
    frozen: list = []
    started = asyncio.Event()

    async def one(http: httpx.AsyncClient, i: int, stream: bool) -> tuple[int, int]:
        body = {"model": "m1", "max_tokens": 80, "ignore_eos": True, "stream": stream,
                "messages": [{"role": "user", "content": f"question {i}"}]}
        if not stream:
            resp = await http.post(fleet.url + "/v1/chat/completions", json=body)
            return resp.status_code, resp.json()["usage"]["completion_tokens"] if resp.status_code == 200 else -1
        body["stream_options"] = {"include_usage": True}
        async with http.stream("POST", fleet.url + "/v1/chat/completions", json=body) as resp:
            raw = b""
            async for piece in resp.aiter_raw():
                raw += piece
                if i == 0 and not frozen and raw.count(b"\n\n") >= 5:
                    victim = by_id[resp.headers["x-kvroute-worker"]]
                    victim.proc.signal(signal.SIGSTOP)  # frozen mid-stream, holding requests
                    frozen.append(victim)
                    started.set()
        events = [orjson.loads(e) for e in sse_events(raw) if e != b"[DONE]"]
        assert not any("error" in e for e in events), events[-2:]
        return resp.status_code, events[-1]["usage"]["completion_tokens"]

    try:
        # a client timeout far below the proxy's own (first byte 300 s, idle 120 s): only moving the
        # frozen worker's requests elsewhere gets every answer in time
        async with httpx.AsyncClient(timeout=httpx.Timeout(25.0)) as http:
            first = asyncio.create_task(one(http, 0, True))
            await asyncio.wait_for(started.wait(), 20)
            others = [one(http, i, i % 2 == 0) for i in range(1, 9)]
            results = await asyncio.gather(first, *others)
        assert results == [(200, 80)] * 9
        stalled = fleet.worker(frozen[0].worker_id)
        assert stalled["state"] == "unhealthy" and stalled["stalled"], stalled
        assert migrations_metric(fleet, "continued") >= 1
    finally:
        for sim in frozen:
            sim.proc.signal(signal.SIGCONT)
    # running again: its next report brings it back
    fleet.wait_workers(lambda ws: all(w["state"] == "ready" and not w["stalled"] for w in ws), timeout=10,
                       what="the thawed worker ready again")


# --- the pieces, without processes ----------------------------------------------------------------------
def test_what_cannot_be_continued():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert migration.refusal(chat, CHAT) is None
    assert migration.refusal({**chat, "n": 2}, CHAT) == "n>1"
    assert migration.refusal({**chat, "logprobs": True, "top_logprobs": 2}, CHAT) == "logprobs"
    assert migration.refusal({**chat, "tools": [{"type": "function"}]}, CHAT) == "tools"
    assert migration.refusal({**chat, "response_format": {"type": "json_object"}}, CHAT) == "structured_output"
    assert migration.refusal({"model": "m", "prompt": "Once"}, COMPLETIONS) is None
    assert migration.refusal({"model": "m", "prompt": [1, 2, 3]}, COMPLETIONS) == "token_prompt"
    assert migration.refusal({"model": "m", "prompt": ["a", "b"]}, COMPLETIONS) == "token_prompt"


def test_a_continuation_appends_the_text_so_far_and_asks_for_what_is_left():
    chat = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "temperature": 0.3,
            "stream": True}
    body = orjson.loads(migration.continuation_body(chat, CHAT, "served", "Once upon", 2))
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 48 and body["temperature"] == 0.3 and body["model"] == "served"
    completion = {"model": "m", "prompt": ["Story:"], "max_completion_tokens": 10}
    body = orjson.loads(migration.continuation_body(completion, COMPLETIONS, "m", " a cat", 3))
    assert body["prompt"] == "Story: a cat" and body["max_completion_tokens"] == 7


def test_the_tracker_passes_whole_events_and_rewrites_a_continuation():
    tracker = migration.StreamTracker(chat=True, include_usage=True)
    role = b'data: {"id":"a","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    tok = b'data: {"id":"a","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" x"}}]}\n\n'
    assert tracker.feed(role + tok[:20]) == role  # a partial event waits for its end
    assert tracker.feed(tok[20:]) == tok
    assert (tracker.text, tracker.tokens) == (" x", 1)
    tracker.begin_continuation()
    cont_role = b'data: {"id":"b","created":2,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    cont_tok = b'data: {"id":"b","created":2,"model":"m","choices":[{"index":0,"delta":{"content":" y"},"finish_reason":"length"}]}\n\n'
    usage = b'data: {"id":"b","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":1,"total_tokens":12}}\n\n'
    out = tracker.feed(cont_role + cont_tok + usage + b"data: [DONE]\n\n")
    events = [orjson.loads(e) for e in sse_events(out) if e != b"[DONE]"]
    assert [e["id"] for e in events] == ["a", "a"] and {e["created"] for e in events} == {1}
    assert events[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert tracker.done and tracker.finished and tracker.tokens == 2
    broken = migration.StreamTracker(chat=True, include_usage=False)
    assert broken.feed(tok + b'data: {"error": {"message": "engine dead"}}\n\n') == tok
    assert broken.broken is not None


def test_a_chat_moves_only_to_engines_that_continue_a_message():
    from proxy.workers.registry import Worker

    assert migration.engine_continues(Worker("v", "http://h:1", ["m"], engine="vllm"), CHAT)
    assert migration.engine_continues(Worker("s", "http://h:2", ["m"], engine="sim"), CHAT)
    for engine in ("turbomind", "pytorch"):
        worker = Worker("t", "http://h:3", ["m"], engine=engine)
        assert not migration.engine_continues(worker, CHAT)
        assert migration.engine_continues(worker, COMPLETIONS)  # a prompt with the text appended: any engine
    assert not migration.engine_continues(Worker("l", "http://h:4", ["m"], source="nodes"), CHAT)  # LMDeploy
    assert migration.engine_continues(Worker("u", "http://h:5", ["m"], source="static"), CHAT)  # vllm serve


def test_the_sim_continues_a_final_assistant_message_like_vllm():
    from backends.sim.openai_api import ApiError, parse_request

    user = {"role": "user", "content": "Tell me a story."}
    fresh = parse_request({"messages": [user], "max_tokens": 5}, "chat", "m", 4096, 0)
    cont = parse_request({"messages": [user, {"role": "assistant", "content": "Once upon a time"}], "max_tokens": 5,
                          "continue_final_message": True, "add_generation_prompt": False}, "chat", "m", 4096, 0)
    # the open assistant message is the generation prompt plus its text: no <|im_end|>, no new header
    assert cont.prompt.token_ids[:len(fresh.prompt.token_ids)] == fresh.prompt.token_ids
    assert len(cont.prompt.token_ids) == len(fresh.prompt.token_ids) + count_text_tokens("Once upon a time")
    assert cont.prompt.continues
    for body, message in (
            ({"messages": [user, {"role": "assistant", "content": "x"}], "continue_final_message": True},
             "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
            ({"messages": [user], "continue_final_message": True, "add_generation_prompt": False},
             "Cannot set `continue_final_message` to True when the last message is not from the assistant.")):
        with pytest.raises(ApiError) as refused:
            parse_request(body, "chat", "m", 4096, 0)
        assert refused.value.status == 400 and refused.value.message == message


def test_a_stalled_worker_gets_no_new_work_until_a_fresh_report():
    from proxy.protocol import LoadReport, WorkerRegistration
    from proxy.workers.registry import Registry, WorkerState

    now = [100.0]
    registry = Registry(clock=lambda: now[0])
    for worker_id in ("a", "b"):
        registry.register(WorkerRegistration(worker_id=worker_id, url=f"http://{worker_id}:1", models=["m"]))

    def report(worker_id: str, seq: int) -> None:
        registry.record_report(worker_id, LoadReport(
            worker_id=worker_id, url=f"http://{worker_id}:1", models=["m"], kv_cache_usage=0.1,
            kv_capacity_tokens=1000, num_running=1, num_waiting=0, seq=seq, state="ready"))

    report("a", 1), report("b", 1)
    a = registry.get("a")
    registry.mark_stalled(a, "stalled: nothing for 2.0s")
    assert a.state(now[0]) is WorkerState.UNHEALTHY and a.to_json(now[0])["stalled"]
    assert [w.worker_id for w in registry.candidates("m")] == ["b"]
    now[0] += 0.5
    report("a", 2)  # it sends again: back in the routing set
    assert a.state(now[0]) is WorkerState.READY
    assert sorted(w.worker_id for w in registry.candidates("m")) == ["a", "b"]
