"""The config a running proxy serves with now, and the routing policies built from it: one holder, swapped
whole when the config changes.

Owns where a live config edit lands (proxy/app.py's `apply_config` calls `update`) and telling the parts
that keep a copy; not which keys may change live (proxy/routing/live_changes.py) nor how policies are built
(proxy/routing/policy_set.py). Readers take `live.proxy`, `live.config` and `live.policies` per request.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.config import FleetConfig, ProxyConfig
from proxy.routing.policy_set import PolicySet


class LiveConfig:
    """The running config and policies; every request reads them from here, so an edit holds from the next."""

    __slots__ = ("config", "proxy", "policies", "_followers")

    def __init__(self, config: FleetConfig, policies: PolicySet) -> None:
        self.config = config
        self.proxy: ProxyConfig = config.proxy
        self.policies = policies
        self._followers: list[Callable[[LiveConfig], None]] = []

    def update(self, config: FleetConfig, policies: PolicySet) -> None:
        """From now on, serve with `config` and `policies`."""
        self.config, self.proxy, self.policies = config, config.proxy, policies
        for follower in self._followers:
            follower(self)

    def follow(self, follower: Callable[[LiveConfig], None]) -> None:
        """Call `follower(self)` after every update: for a part that keeps its own copy of a setting."""
        self._followers.append(follower)
