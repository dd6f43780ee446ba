"""The routing policy of each model: the model's own from config, else the global one.

Owns which Policy object serves which model, and keeping policies (and what they learnt) across config
edits where the name is unchanged; not how a policy decides (one module each beside this one).
"""

from __future__ import annotations

from proxy.config import FleetConfig
from proxy.routing.base import Policy, PolicyDeps, assign_policies


class PolicySet:
    """The policy for each model: the model's own from config, else the global one."""

    def __init__(self, config: FleetConfig, global_policy: str, deps: PolicyDeps,
                 reuse: PolicySet | None = None) -> None:
        """`reuse`: a running set whose policy objects are kept where the name is unchanged (what they learnt)."""
        self.deps = deps
        self.default, self._by_model = assign_policies(config, global_policy, deps, reuse and reuse.default,
                                                       reuse and reuse._by_model)

    def for_model(self, model: str) -> Policy:
        return self._by_model.get(model, self.default)
