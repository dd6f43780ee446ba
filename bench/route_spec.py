"""A kvroute route spec's knobs (`kv_aware@prefix_weight=0+hw=1.0`) as the config the bench starts the proxy with.

Owns reading the knobs after `@`: routing knobs and any other `proxy` key go into config.yaml's `proxy` section as an
operator would write them, checked by the proxy's own loader before anything starts; the process settings no config
holds go to bench/ablate.py; `tree=PATH` names another source tree. It starts nothing (bench/fleet.py does).

A knob is named by its config key: `prefix_weight` (the route's policy's own key first, then the one routing section
that has it, then a `proxy` key such as `kv_high_water`), `kv_cost.shortlist` (a section of `proxy.routing`), or a
dotted `proxy` path (`queue.max_wait_s`, `routing.admission.admit_after_head`). Values are YAML (`true`, `0.5`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.ablate import PROCESS_KNOBS
from proxy.config import ConfigError, ProxyConfig, parse_config
from proxy.routing_config import RoutingConfig

# Knob names of earlier runs' commands (bench/results/), before the routing knobs were config keys.
RENAMED = {
    "hw": "kv_high_water", "queue_wait": "queue.max_wait_s", "queue_len": "queue.max_length",
    "prefix_saturation": "kv_aware.prefix_saturation_tokens", "cached_credit": "kv_aware.cached_prefill_credit",
    "credit_per_share": "kv_aware.credit_per_cache_share", "resolution": "kv_cost.resolution_s",
    "forget_after": "admission.dispatch_forget_after_s", "visible_after": "admission.dispatch_visible_after_s",
    "admit_above_kv": "admission.confirm_above_kv_usage", "admit_prefill": "admission.confirm_above_prefill_tokens",
    "prior_prefill_rate": "estimator.prior_prefill_tokens_per_s", "forget": "estimator.forgetting_factor",
}
SECTIONS = tuple(RoutingConfig.model_fields)


@dataclass
class RouteSpec:
    """What one kvroute route spec asks for."""

    policy: str
    proxy: dict[str, Any] = field(default_factory=dict)  # config.yaml's `proxy` section
    process: list[str] = field(default_factory=list)  # MODULE.ATTR=VALUE for bench/ablate.py
    tree: str | None = None  # another kvroute source tree to run the proxy from

    def write_config(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"proxy": self.proxy}))  # JSON is YAML
        return path


def parse_route_spec(spec: str) -> RouteSpec:
    """`POLICY@KNOB=VALUE+...`; ValueError naming the knob for an unknown name or a value the config refuses."""
    policy, _, knobs = spec.partition("@")
    route = RouteSpec(policy)
    for item in filter(None, knobs.split("+")):
        key, _, value = item.partition("=")
        if key == "tree":
            if not (Path(value) / "proxy" / "cli.py").is_file():
                raise ValueError(f"tree={value!r} in {spec!r} is not a kvroute source tree (no proxy/cli.py)")
            route.tree = str(Path(value).resolve())
        elif key in PROCESS_KNOBS:
            route.process.append(f"{PROCESS_KNOBS[key]}={value}")
        else:
            node = route.proxy
            *parents, leaf = config_path(key, policy, spec)
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = yaml.safe_load(value)
    if route.proxy:
        try:
            parse_config(json.dumps({"proxy": route.proxy}), source=f"route {spec!r}", env={})
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return route


def config_path(knob: str, policy: str, spec: str = "") -> list[str]:
    """The path under config.yaml's `proxy` that a knob name sets (see the module docstring)."""
    name = RENAMED.get(knob, knob)
    first, dot, rest = name.partition(".")
    if dot:
        return ["routing", first, *rest.split(".")] if first in SECTIONS else name.split(".")
    routing = RoutingConfig()
    if policy in SECTIONS and name in type(getattr(routing, policy)).model_fields:
        return ["routing", policy, name]
    owners = [s for s in SECTIONS if name in type(getattr(routing, s)).model_fields]
    if len(owners) == 1:
        return ["routing", owners[0], name]
    if owners:
        raise ValueError(f"knob {knob!r} in {spec!r} is a key of {', '.join(owners)}: say which, as "
                         f"{owners[0]}.{name}")
    if name in ProxyConfig.model_fields:
        return [name]
    raise ValueError(f"unknown knob {knob!r} in {spec!r}: not a key of proxy.routing's sections "
                     f"({', '.join(SECTIONS)}) or of proxy, nor a process setting ({', '.join(PROCESS_KNOBS)})")
