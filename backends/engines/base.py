"""What an engine adapter is: how to launch one engine's OpenAI server and read its load.

Owns the adapter interface and the launch description (/metrics text is parsed by proxy/promtext.py);
it does not start processes (backends/worker.py does) nor talk to the proxy (reporter.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

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

    def has_arg(self, *names: str) -> bool:
        """True when the user already passed one of these flags (as `--flag v` or `--flag=v`)."""
        return any(a == n or a.startswith(n + "=") for a in self.engine_args for n in names)


class EngineAdapter(Protocol):
    """One engine family (vLLM, LMDeploy). Instances hold per-worker reading state."""

    family: str  # the --engine name: "vllm" | "turbomind"
    ready_path: str  # GET on the engine that answers 200 once it serves

    def command(self, launch: EngineLaunch) -> list[str]: ...

    def environment(self, launch: EngineLaunch, base: Mapping[str, str]) -> dict[str, str]: ...

    def observe_log_line(self, line: str) -> None:
        """Called with every line the engine prints (e.g. to learn which backend really runs)."""

    @property
    def running_engine(self) -> str:
        """The engine actually serving, as protocol.EngineName ('vllm', 'turbomind', 'pytorch')."""

    async def read_load(self, session: aiohttp.ClientSession, base_url: str) -> Load: ...

    async def in_flight(self, session: aiohttp.ClientSession, base_url: str) -> int | None:
        """Requests the engine's HTTP server is handling now (streams included), or None if it cannot say.

        Drain waits on this: the engine's scheduler gauges miss requests still in its API layer.
        """


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()
