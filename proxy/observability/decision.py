"""Explained decisions: the `x-kvroute-decision` response header an admin asks for with `x-kvroute-debug: 1`.

Owns who may ask (the control plane's admin rule: the admin token, on loopback too) and the header's text (policy, reason, chosen worker, best candidates with their scores).
Not the decision itself: only Decision's worker, reason and scores are read.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping

from proxy.observability.tracing import best_candidates
from proxy.security.controlauth import presented_token, token_or_none

DEBUG_HEADER = b"x-kvroute-debug"
DECISION_HEADER = b"x-kvroute-decision"
# Where a client's Authorization carries its API key, the admin token comes in this header (never forwarded).
ADMIN_TOKEN_HEADER = b"x-kvroute-admin-token"
HEADER_CANDIDATES = 8
MAX_ID_CHARS = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+-]")
_PLAN_UNSAFE = re.compile(r"[^A-Za-z0-9 ._:/@+(),-]")  # printable ASCII, no quote nor the parts' separator
MAX_PLAN_CHARS = 240


class DebugGate:
    """Whether a request's `x-kvroute-debug` is honoured: the same rule as the control plane's admin."""

    def __init__(self, admin_token: str | None, open_control_plane: bool) -> None:
        token = token_or_none(admin_token)
        self.admin_token = token.encode() if token is not None else None
        self.open = open_control_plane

    def allows(self, peer: bytes, authorization: bytes | None, admin_header: bytes | None) -> bool:
        expected = self.admin_token
        if expected is None:
            return self.open
        for given in (admin_header.strip() if admin_header else None,
                      presented_token(authorization.decode("latin-1")) if authorization else None):
            if given is not None and hmac.compare_digest(given, expected):
                return True
        return False


def wants_debug(value: bytes | None) -> bool:
    return value is not None and value.strip().lower() in (b"1", b"true", b"yes", b"on")


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text[:MAX_ID_CHARS])


def explain(policy: str, reason: str, chosen: str, scores: Mapping[str, float] | None, attempt: int = 1,
            plan: str | None = None) -> bytes:
    """The header line: `policy=P; reason=R; chosen=W; candidates=W1:S1,W2:S2 (+N more)`, best (lowest) first,
    at most HEADER_CANDIDATES of them, ASCII only. Policies that do not score give no candidates. A
    disaggregated model's `plan` (its stages, why, the predicted first token) comes as `plan="..."`."""
    parts = [f"policy={_safe(policy)}", f"reason={_safe(reason)}", f"chosen={_safe(chosen)}"]
    if attempt > 1:
        parts.append(f"attempt={attempt}")
    if plan is not None:
        shown = _PLAN_UNSAFE.sub("_", plan[:MAX_PLAN_CHARS].replace(";", ","))
        parts.append(f'plan="{shown}"')
    best = best_candidates(scores, HEADER_CANDIDATES)
    if best:
        listed = ",".join(f"{_safe(w)}:{s:.4g}" for w, s in best)
        more = len(scores) - len(best) if scores else 0
        parts.append(f"candidates={listed}" + (f" (+{more} more)" if more > 0 else ""))
    return DECISION_HEADER + b": " + "; ".join(parts).encode("ascii") + b"\r\n"
