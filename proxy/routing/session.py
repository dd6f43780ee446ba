"""session: the same session key (x-session-id header, else the body's `user`) -> the same worker.

Rendezvous (highest-random-weight) hashing, so adding or removing a worker moves only the
sessions that belonged to it. Requests without a key go to the least-loaded worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from proxy.request import RoutedRequest
from proxy.routing.base import Decision, Policy
from proxy.workers.registry import Worker


def _weight(session_key: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{session_key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SessionPolicy(Policy):
    name = "session"

    def select(self, candidates: Sequence[Worker], request: RoutedRequest, now: float) -> Decision:
        key = request.session_key
        if key is None:
            return Decision(self.least_in_flight(candidates), "no_session_key", request.expected_kv_tokens)
        worker = max(candidates, key=lambda w: _weight(key, w.worker_id))
        return Decision(worker, "session_hash", request.expected_kv_tokens)
