"""Which proxy settings a running proxy takes from a new config, and which need a restart.

Pure: compares two ProxyConfigs and says what changes live (policy, routing knobs, retries, timeouts, ...) and
what is only reported; applying the result to a running app is proxy/app.py's `apply_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.config import ConfigError, FleetConfig
from proxy.routing.base import policy_names

# Read per request (dispatch, admission, upstream) or per drain: a new value takes effect at once. `routing`'s
# knobs go to the running policies, prefix index, estimator and load views (what they learnt is kept).
LIVE_PROXY_KEYS = ("policy", "retries", "migrations", "kv_high_water", "timeouts", "queue", "routing", "drain_grace_s",
                   "log_level", "media_urls")
# The command line may set these (`--host`, `--port 0`): a file that does not say them changes nothing.
_COMMAND_LINE_KEYS = ("host", "port")


@dataclass
class ConfigChange:
    config: FleetConfig                   # what the running proxy uses from now on
    live: list[str] = field(default_factory=list)      # proxy keys (and models' own routing) changed at once
    restart: list[str] = field(default_factory=list)   # keys the new config changes that need a restart

    def describe(self) -> str | None:
        """One line for the plan of `kvroute apply` / a file edit; None when no proxy setting changed."""
        parts = []
        if self.live:
            parts.append(f"changed live: {', '.join(self.live)}")
        if self.restart:
            parts.append(f"NOT applied, they need a restart of the proxy: {', '.join(self.restart)}")
        return "; ".join(parts) or None


def merge(running: FleetConfig, new: FleetConfig) -> ConfigChange:
    """`new`'s models and live proxy keys on top of `running`'s other proxy keys and state.

    Raises ConfigError for a policy name no proxy knows (the running config is then kept whole)."""
    known = policy_names()
    unknown = [f"{path}: unknown routing policy '{name}'; known: {', '.join(known)}"
               for path, name in [("proxy.policy", new.proxy.policy),
                                  *((f"models[{i}].policy", m.policy) for i, m in enumerate(new.models))]
               if name is not None and name not in known]
    if unknown:
        raise ConfigError(unknown, "new config")
    live = [f"proxy.{k}" for k in LIVE_PROXY_KEYS if getattr(running.proxy, k) != getattr(new.proxy, k)]
    # a running model's own knobs change live too (a new model's come with it)
    knobs_before = {m.name: m.routing for m in running.models}
    live += [f"models[{i}].routing" for i, m in enumerate(new.models)
             if m.name in knobs_before and knobs_before[m.name] != m.routing]
    restart = [f"proxy.{k}" for k in new.proxy.model_fields_set
               if k not in LIVE_PROXY_KEYS and k not in _COMMAND_LINE_KEYS
               and getattr(running.proxy, k) != getattr(new.proxy, k)]
    if new.state != running.state and "state" in new.model_fields_set:
        restart.append("state")
    proxy = running.proxy.model_copy(update={k: getattr(new.proxy, k) for k in LIVE_PROXY_KEYS})
    config = new.model_copy(update={"proxy": proxy, "state": running.state})
    return ConfigChange(config, live, sorted(restart))
