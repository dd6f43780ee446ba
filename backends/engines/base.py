"""What an engine adapter is: how to launch one engine's OpenAI server and read its load.

Owns the adapter interface and the launch description (/metrics text is parsed by proxy/promtext.py);
it does not start processes (backends/worker.py does) nor talk to the proxy (reporter.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from backends.reporter import Load


@dataclass
class EngineLaunch:
    """Everything an adapter needs to build the engine's command line and environment."""

    model: str
    served_model_name: str
    host: str
    port: int
    device: str  # "cpu" | "cuda"
    gpus: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    # disaggregated serving: the worker's pool role, and its --kv-transfer / --ec-transfer (parsed JSON)
    role: str = "both"
    kv_transfer: dict[str, Any] | None = None
    ec_transfer: dict[str, Any] | None = None
    advertise_host: str | None = None  # the host the proxy and other workers reach this one at
    # where the engine publishes its KV-cache events (vLLM's --kv-events-config), when the worker forwards them
    kv_events: dict[str, Any] | None = None

    def has_arg(self, *names: str) -> bool:
        """True when the user already passed one of these flags (as `--flag v` or `--flag=v`)."""
        return any(a == n or a.startswith(n + "=") for a in self.engine_args for n in names)

    def arg_value(self, name: str) -> str | None:
        """The value the user gave a flag (`--flag v` or `--flag=v`; the last one wins), else None."""
        value = None
        args = self.engine_args
        for i, arg in enumerate(args):
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
        return value

    def int_arg(self, name: str) -> int | None:
        """arg_value() as a positive int, else None."""
        value = self.arg_value(name)
        return int(value) if value is not None and value.strip().isdigit() and int(value) > 0 else None


class EngineAdapter(Protocol):
    """One engine family (vLLM, LMDeploy). Instances hold per-worker reading state."""

    family: str  # the --engine name: "vllm" | "turbomind"
    ready_path: str  # GET on the engine that answers 200 once it serves

    def command(self, launch: EngineLaunch) -> list[str]: ...

    def environment(self, launch: EngineLaunch, base: Mapping[str, str]) -> dict[str, str]: ...

    def observe_log_line(self, line: str) -> None:
        """Called with every line the engine prints (e.g. to learn which backend really runs)."""

    def kv_event_scheme(self, launch: EngineLaunch, env: Mapping[str, str]) -> tuple[str, str] | None:
        """(hash algorithm, NONE_HASH seed) the engine will name its KV blocks by when it publishes KV events
        that a proxy can follow; None when it will not (no events, or hashes the proxy cannot recompute)."""

    @property
    def running_engine(self) -> str:
        """The engine actually serving, as protocol.EngineName ('vllm', 'turbomind', 'pytorch')."""

    async def read_load(self, session: aiohttp.ClientSession, base_url: str) -> Load: ...

    async def in_flight(self, session: aiohttp.ClientSession, base_url: str) -> int | None:
        """Requests the engine's HTTP server is handling now (streams included), or None if it cannot say.

        Drain waits on this: the engine's scheduler gauges miss requests still in its API layer.
        """


class MetricsReader:
    """Reads an engine's `/metrics`, asking only for the samples its adapter parses.

    prometheus_client's exposition honours `?name[]=<sample>`. vLLM serves two: its `/metrics` route
    (prometheus-fastapi-instrumentator's, which ignores the filter) and, behind it, prometheus_client's own
    app mounted on `/metrics/...`, which filters. Asked at `/metrics/`, a vLLM reading shrinks from ~50 KB
    (~3 ms of its API server's CPU on the 2-core box, bench/results/*-vllm-report-path.md) to ~3 KB, so the
    worker can report as often as the proxy asks (protocol.REPORT_INTERVAL_S). An engine whose filtered
    answer lacks `probe` (no such mount, an error) while its full one has it is read at `/metrics` from then on.
    """

    def __init__(self, names: tuple[str, ...], probe: str) -> None:
        self.params = [("name[]", name) for name in names]
        self.probe = probe
        self.filtered = True  # False once the engine showed it does not filter

    async def read(self, session: aiohttp.ClientSession, base_url: str) -> str:
        if self.filtered:
            with contextlib.suppress(aiohttp.ClientResponseError):
                text = await _get_metrics(session, f"{base_url}/metrics/", self.params)
                if self.probe in text:
                    return text
        text = await _get_metrics(session, f"{base_url}/metrics", None)
        if self.probe in text:
            self.filtered = False
        return text


async def _get_metrics(session: aiohttp.ClientSession, url: str, params: list[tuple[str, str]] | None) -> str:
    # loopback: compressing costs the engine more CPU than the bytes cost the socket
    async with session.get(url, params=params, headers={"Accept-Encoding": "identity"}) as resp:
        resp.raise_for_status()
        return await resp.text()
