"""A worker's part in a disaggregated fleet: its --role, --kv-transfer and --ec-transfer flags.

Owns parsing those flags and the registration labels they give (which KV connector, which kv_role); how each
engine acts on them is its adapter's (backends/engines/vllm.py) or the sim's (backends/sim/transfer.py).
"""

from __future__ import annotations

import json
from typing import Any


def transfer_flag(value: str | None, flag: str) -> dict[str, Any] | None:
    """--kv-transfer / --ec-transfer JSON as a dict (None when absent); SystemExit names the flag when bad."""
    if not value:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise SystemExit(f"kvroute worker: {flag} is not JSON: {exc}") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("connector"), str):
        raise SystemExit(f'kvroute worker: {flag} must be a JSON object with a "connector"')
    return parsed


def role_labels(kv_transfer: dict[str, Any] | None) -> dict[str, str]:
    """What the proxy needs to know of a worker's KV connector: its name (whether a decode worker needs the
    prefill answer's kv_transfer_params), its kv_role and the link it moves KV over."""
    if not kv_transfer:
        return {}
    labels = {"kv_connector": str(kv_transfer["connector"]), "kv_role": str(kv_transfer.get("kv_role", "kv_both"))}
    if kv_transfer.get("link"):  # the network to the other pools, for the proxy's transfer-time predictions
        labels["kv_link"] = str(kv_transfer["link"])
    return labels
