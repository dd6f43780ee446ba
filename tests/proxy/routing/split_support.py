"""What the split and flexible policy tests share: a RoutingService over hand-registered sim workers of model "m",
long and short chat requests, and a pick that must not wait."""

from __future__ import annotations

import random

import orjson

from proxy.config import FleetConfig
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.request import CHAT, parse_request
from proxy.routing.base import PolicyDeps
from proxy.routing.live import LiveConfig
from proxy.routing.policy_set import PolicySet
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing.service import RoutingService
from proxy.workers.registry import Registry

LONG = " ".join(f"word{i}" for i in range(6000))


def routing_service(config: FleetConfig) -> tuple[Registry, RoutingService]:
    registry = Registry(clock=lambda: 100.0)
    deps = PolicyDeps(prefix_index=PrefixIndex(), rng=random.Random(1))
    return registry, RoutingService(LiveConfig(config, PolicySet(config, "kv_aware", deps)), registry)


def add_worker(registry: Registry, wid: str, role: str, labels: dict[str, str], running: int) -> None:
    """A sim worker of model "m" with 300k tokens of KV, 10% used, `running` requests and none waiting."""
    registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}", models=["m"], engine="sim",
                                         kv_capacity_tokens=300_000, role=role, labels=labels))
    registry.record_report(wid, LoadReport(worker_id=wid, url=f"http://{wid}", models=["m"], engine="sim",
                                           kv_cache_usage=0.1, kv_capacity_tokens=300_000,
                                           num_running=running, num_waiting=0, seq=1))


def request(text: str = LONG, **extra: object):
    return parse_request(orjson.dumps({"model": "m", "max_tokens": 64, "stream": True, **extra,
                                       "messages": [{"role": "user", "content": text}]}), CHAT)


def pick(routing: RoutingService, routed, tried: set[str] | None = None):
    coro = routing.pick(routing.policy_for("m"), routed, "m", tried or set(), first_attempt=not tried)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the pick waited")
