"""Admission: the proxy never holds what an engine would admit; held requests leave in FIFO order on events.

Driven on a real Registry and AdmissionController with a hand-set clock: nothing here sleeps, and
every release happens within loop turns of the event that caused it (no timer could have fired).
"""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from proxy.config import ProxyConfig
from proxy.errors import ProxyError
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.request import CHAT, parse_request
from proxy.routing.admission import AdmissionController
from proxy.routing.base import PolicyDeps, make_policy
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing_config import AdmissionConfig
from proxy.workers.registry import Registry

DISPATCH_VISIBLE_AFTER_S = AdmissionConfig().dispatch_visible_after_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(workers: dict[str, int | None] | None = None, **proxy: object):
    """A registry with workers (id -> max_model_len), an admission controller and kv_cost."""
    clock = Clock()
    registry = Registry(clock=clock)
    deps = PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(1))
    admission = AdmissionController(registry, ProxyConfig(**proxy), deps.estimator)
    policy = make_policy("kv_cost", deps)
    for wid, max_len in (workers if workers is not None else {"a": None}).items():
        registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}", models=["m"], engine="sim",
                                             kv_capacity_tokens=100_000, max_model_len=max_len))
    return clock, registry, admission, policy


_seq = iter(range(1, 10**9))


def report(registry: Registry, wid: str, usage: float, running: int = 0, waiting: int = 0) -> None:
    registry.record_report(wid, LoadReport(worker_id=wid, url=f"http://{wid}", models=["m"], engine="sim",
                                           kv_cache_usage=usage, kv_capacity_tokens=100_000, num_running=running,
                                           num_waiting=waiting, seq=next(_seq)))


def chat(text: str = "hello", max_tokens: int | None = 16, kind: str = CHAT):
    body: dict = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_request(orjson.dumps(body), kind)


def admit_without_suspending(admission, policy, request, tried=()):
    """admit() driven by hand: it must finish at its first step, i.e. without waiting for anything."""
    coro = admission.admit(policy, request, "m", set(tried), first_attempt=not tried)
    with pytest.raises(StopIteration) as done:
        coro.send(None)
    return done.value.value


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_full_kv_cache_that_is_not_queueing_gets_the_request_at_once():
    _, registry, admission, policy = setup({"a": None, "b": None})
    report(registry, "a", 0.99, running=60)
    report(registry, "b", 0.98, running=60)
    decision = admit_without_suspending(admission, policy, chat())
    assert decision.worker.worker_id in {"a", "b"} and admission.queue_lengths() == {}


def test_one_engine_that_admits_is_enough_even_when_the_others_queue():
    _, registry, admission, policy = setup({"a": None, "b": None})
    report(registry, "a", 1.0, running=60, waiting=12)
    report(registry, "b", 0.95, running=60, waiting=0)
    assert admit_without_suspending(admission, policy, chat()).worker.worker_id == "b"


def start_visible(registry, clock, wid: str, count: int):
    """`count` requests in flight on `wid` that its next report already shows."""
    load = registry.get(wid).load
    dispatches = [load.start_request(100, clock.now) for _ in range(count)]
    clock.now += DISPATCH_VISIBLE_AFTER_S + 0.01
    return dispatches


def test_waiters_leave_in_arrival_order_one_per_completion_with_no_timer():
    async def scenario():
        clock, registry, admission, policy = setup({"a": None, "b": None},
                                                   queue={"max_length": 8, "max_wait_s": 3600})
        running = {wid: start_visible(registry, clock, wid, 2) for wid in ("a", "b")}
        for wid in ("a", "b"):  # both engines queue one request: the first of them to free one wins
            report(registry, wid, 1.0, running=2, waiting=1)
        tasks = [asyncio.create_task(admission.admit(policy, chat(f"q{i}"), "m", set(), True)) for i in range(3)]
        await turns()
        assert admission.queue_lengths() == {"m": 3} and not any(t.done() for t in tasks)
        released: dict[int, tuple[int, str]] = {}  # waiter -> (the completion that released it, where to)
        completions = [("a", running["a"][0]), ("b", running["b"][0]), ("a", running["a"][1])]
        for k, (wid, finished) in enumerate(completions, start=1):
            registry.get(wid).load.finish_request(finished)   # what RoutingService.end() does ...
            admission.wake()                                   # ... and then this
            await turns()
            for i, task in enumerate(tasks):
                if task.done() and i not in released:  # it is sent: RoutingService.begin()'s accounting + wake
                    decision = task.result()
                    released[i] = (k, decision.worker.worker_id)
                    decision.worker.load.start_request(100, clock.now)
                    admission.wake()
            await turns()
        # each completion let the engine take the one it had waiting, then the proxy's head (late
        # binding: to the worker that freed), first come first served
        assert released == {0: (1, "a"), 1: (2, "b"), 2: (3, "a")}, released
        assert admission.queue_lengths() == {"m": 0}

    asyncio.run(scenario())


def test_with_one_engine_sending_now_is_as_good_as_holding_so_nothing_is_held():
    _, registry, admission, policy = setup({"a": None})
    report(registry, "a", 1.0, running=2, waiting=1)
    assert admit_without_suspending(admission, policy, chat()).worker.worker_id == "a"


def test_a_new_arrival_queues_behind_a_waiter_even_when_a_worker_just_freed():
    async def scenario():
        clock, registry, admission, policy = setup({"a": None, "b": None},
                                                   queue={"max_length": 8, "max_wait_s": 3600})
        report(registry, "a", 1.0, running=2, waiting=3)
        report(registry, "b", 1.0, running=2, waiting=3)
        first = asyncio.create_task(admission.admit(policy, chat("first"), "m", set(), True))
        await turns()
        registry.get("a").load.reading.num_waiting = 0  # room, but no event has said so yet
        second = asyncio.create_task(admission.admit(policy, chat("second"), "m", set(), True))
        await turns()
        assert admission.queue_lengths() == {"m": 2}
        admission.wake()
        await turns()
        assert first.done() and not second.done()
        admission.wake()
        await turns()
        assert second.done()

    asyncio.run(scenario())


def test_the_queue_is_bounded_429_when_full_and_503_with_retry_after_past_the_wait():
    async def scenario():
        _, registry, admission, policy = setup({"a": None, "b": None}, queue={"max_length": 1, "max_wait_s": 0.05})
        report(registry, "a", 1.0, running=2, waiting=3)
        report(registry, "b", 1.0, running=2, waiting=3)
        held = asyncio.create_task(admission.admit(policy, chat(), "m", set(), True))
        await turns()
        with pytest.raises(ProxyError) as full:
            await admission.admit(policy, chat(), "m", set(), True)
        assert full.value.status == 429 and full.value.code == "queue_full"
        with pytest.raises(ProxyError) as timed_out:
            await held
        assert timed_out.value.status == 503 and timed_out.value.code == "queue_timeout"
        assert timed_out.value.headers["Retry-After"]
        assert admission.queue_lengths() == {"m": 0}

    asyncio.run(scenario())


def test_a_request_for_a_model_without_workers_yet_waits_for_the_first_to_register():
    async def scenario():
        _, registry, admission, policy = setup({}, queue={"max_length": 8, "max_wait_s": 3600})
        task = asyncio.create_task(admission.admit(policy, chat(), "m", set(), True))
        await turns()
        assert not task.done()
        registry.register(WorkerRegistration(worker_id="late", url="http://late", models=["m"], engine="sim"))
        await turns()
        assert (await task).worker.worker_id == "late"

    asyncio.run(scenario())


def counted(request, prompt_tokens: int):
    """`request` as if its model's tokenizer had counted it: `prompt_tokens` is the engine's own count."""
    request.prompt_tokens, request.exact_tokens = prompt_tokens, True
    return request


def test_a_counted_prompt_that_fits_no_worker_is_refused_400_with_the_engines_message():
    _, _, admission, policy = setup({"a": 4096, "b": 8192})
    with pytest.raises(ProxyError) as refused:
        admit_without_suspending(admission, policy, counted(chat("word " * 8000, max_tokens=100), 9000))
    error = refused.value
    assert error.status == 400 and error.code == "context_length_exceeded" and error.param == "input_tokens"
    assert error.err_type == "invalid_request_error"
    assert error.message == ("This model's maximum context length is 8192 tokens. However, your prompt contains "
                             "at least 8193 input tokens, which exceeds this limit even without any output tokens. "
                             "Please reduce the length of the input prompt. (parameter=input_tokens, value=8193)")
    # vLLM 0.32 takes a prompt one token short of max_model_len, cutting max_tokens to what is left ...
    assert admit_without_suspending(admission, policy, counted(chat(max_tokens=7000), 8191)).worker.worker_id == "b"
    assert admit_without_suspending(admission, policy, counted(chat(max_tokens=None), 8191)).worker.worker_id == "b"
    # ... but none that leaves nothing to generate, nor a max_tokens past max_model_len
    with pytest.raises(ProxyError) as full:
        admit_without_suspending(admission, policy, counted(chat(max_tokens=None), 8192))
    assert full.value.message == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    with pytest.raises(ProxyError) as too_many:
        admit_without_suspending(admission, policy, counted(chat(max_tokens=9000), 10))
    assert too_many.value.param == "max_tokens" and too_many.value.message.startswith(
        "max_tokens=9000 cannot be greater than max_model_len=8192.")


def test_an_estimated_prompt_is_never_refused_for_its_length():
    """Without the model's tokenizer the count is a guess: the engine judges, and its answer goes back."""
    _, _, admission, policy = setup({"a": 4096, "b": 8192})
    decision = admit_without_suspending(admission, policy, chat("word " * 12000, max_tokens=9000))  # ~12k tokens
    assert decision.worker.worker_id in ("a", "b")


def test_a_prompt_that_fits_only_some_workers_goes_only_to_those():
    _, registry, admission, policy = setup({"small": 4096, "big": 32768})
    report(registry, "small", 0.0)
    report(registry, "big", 0.9, running=50)  # busier, but the only one the prompt fits
    for i in range(5):
        decision = admit_without_suspending(admission, policy, counted(chat(f"{i} " + "word " * 4000, max_tokens=64),
                                                                       5000))
        assert decision.worker.worker_id == "big"
    assert admit_without_suspending(admission, policy, chat("short")).worker.worker_id == "small"


def test_kv_high_water_below_one_keeps_the_old_gate_when_asked_for():
    async def scenario():
        _, registry, admission, policy = setup({"a": None}, kv_high_water=0.9,
                                               queue={"max_length": 8, "max_wait_s": 3600})
        report(registry, "a", 0.95)
        task = asyncio.create_task(admission.admit(policy, chat(), "m", set(), True))
        await turns()
        assert not task.done()
        report(registry, "a", 0.5)
        await turns()
        assert task.done()

    asyncio.run(scenario())


def test_with_admit_after_output_requests_sent_since_the_report_hold_the_next_until_one_has_output():
    # at any KV use and prompt length
    rules = {"admit_after_output": True, "confirm_above_kv_usage": 0.0, "confirm_above_prefill_tokens": 0}

    async def scenario():
        clock, registry, admission, _ = setup({"a": None, "b": None}, queue={"max_length": 8, "max_wait_s": 3600},
                                              routing={"admission": rules})
        policy = make_policy("kv_aware", PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(1)))
        for wid in ("a", "b"):
            report(registry, wid, 0.5, running=4, waiting=0)
        sent = {wid: registry.get(wid).load.start_request(100, clock.now, prefill_tokens=90) for wid in ("a", "b")}
        task = asyncio.create_task(admission.admit(policy, chat(), "m", set(), True))
        await turns()
        assert admission.queue_lengths() == {"m": 1} and not task.done()  # neither engine has shown it took its own
        registry.get("b").load.first_output(sent["b"])  # what RoutingService.first_output() does ...
        admission.wake()                                 # ... and then this (no timer, no report)
        await turns()
        assert task.done() and task.result().worker.worker_id == "b"

    asyncio.run(scenario())


async def test_kv_aware_holds_even_a_prefix_owners_request_while_every_engine_queues_and_places_it_on_its_owner():
    clock, registry, admission, _ = setup({"a": None, "b": None})
    deps = PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(1))
    policy = make_policy("kv_aware", deps)
    request = chat("Shared instructions. " * 400 + "question")
    deps.cached_prefix.insert(request, "a", clock.now)  # "a" caches the whole prompt
    report(registry, "a", 0.9, running=60, waiting=4)
    report(registry, "b", 0.9, running=60, waiting=4)  # every engine queueing
    waiter = asyncio.ensure_future(admission.admit(policy, request, "m", set(), first_attempt=True))
    await turns()
    assert not waiter.done() and admission.queue_lengths() == {"m": 1}  # held for late binding
    report(registry, "b", 0.5, running=30, waiting=0)  # "b" frees room: the held request is placed now
    await turns()
    # on its owner still, by kv_aware's cost: a freed engine would prefill the whole prompt again
    assert waiter.done() and waiter.result().worker.worker_id == "a"
