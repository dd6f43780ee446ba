"""One completion request on its way through the data plane: what the journey's stages hand each other.

Owns the per-request state: who asked and for what (intake.py fills it), what each attempt sends (head.py),
which workers were tried and how the last one failed (attempt.py, classify.py), what a split request's
earlier stages handed over (stages.py); what is recorded and answered from it is record.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.dataplane.classify import RetryBudget
from proxy.dataplane.head import UpstreamHead
from proxy.dataplane.incoming import IncomingRequest
from proxy.dataplane.migration import StreamTracker
from proxy.dataplane.outcome import Retryable
from proxy.observability.request_watch import RequestWatch
from proxy.request import RoutedRequest
from proxy.routing.base import Policy
from proxy.workers.registry import Worker


@dataclass(slots=True)
class Handoff:
    """What a split request's earlier stages left for the worker that generates: the encoder's output params, and
    the prefill worker holding the prompt's KV with the params that name it (stages.py)."""

    encoded: bool = False  # the encode leg ran (whatever it gave)
    encoder: str | None = None  # the encode worker whose output the next legs fetch ...
    ec_params: dict[str, Any] | None = None  # ... by these params
    prefill: Worker | None = None  # None: no prefill done yet (or its KV was let go)
    kv_params: dict[str, Any] | None = None  # None after a prefill: the connector finds the KV by the prompt


class Trip:
    """One request's journey so far. The fields below `model_label` are set once intake admitted it."""

    __slots__ = ("req", "rid", "watch", "model_label", "routed", "served", "policy", "body", "head", "mode",
                 "tracker", "tried", "budget", "explained", "last_failure", "last_worker", "handoff")

    routed: RoutedRequest
    served: str                         # the model name workers serve (an alias resolved)
    policy: Policy
    body: bytes                         # what a first attempt sends (the model name as the worker knows it)
    head: UpstreamHead
    mode: int                           # outcome.STREAM or outcome.WHOLE
    tracker: StreamTracker | None       # a stream that may migrate: its events are read
    tried: set[str]                     # worker ids this request went to
    budget: RetryBudget

    def __init__(self, req: IncomingRequest, rid: str, watch: RequestWatch) -> None:
        self.req = req
        self.rid = rid
        self.watch = watch              # its trace, access-log line and explained decision
        self.model_label = "unknown"    # its metrics label so far: the name asked for, then the model served
        self.explained = b""            # the x-kvroute-decision header line of the last pick (admins only)
        self.last_failure: Retryable | None = None
        self.last_worker: Worker | None = None
        self.handoff: Handoff | None = None  # a split request's stages so far (stages.py)
