"""Helpers for sim tests: start a real `kvroute worker --engine sim` process and read its /metrics."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import Proc, ProcessGroup, wait_until

LISTENING = re.compile(r"kvroute-sim listening on (http://\S+)")


def start_sim(procs: ProcessGroup, *args: str, name: str = "sim", timeout: float = 30.0) -> tuple[Proc, str]:
    """Start a sim worker on a free port (--port 0) and return it with its base URL once it listens."""
    proc = procs.kvroute("worker", "--engine", "sim", "--host", "127.0.0.1", "--port", "0", *args, name=name)

    def listening() -> str | None:
        if not proc.alive():
            raise RuntimeError(f"sim worker exited early:\n{proc.log()}")
        match = LISTENING.search(proc.log())
        return match.group(1) if match else None

    url = wait_until(listening, timeout, what="the sim worker to listen")
    return proc, url


def png_data_url(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> str:
    """A real PNG of the given size as a base64 `data:` URL."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def read_metrics(base_url: str) -> dict[str, float]:
    """Flat view of /metrics: sample name (plus `_bucket{le}` left out) -> value, labels dropped."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = sample.value
    return values


def read_state(base_url: str) -> dict:
    return httpx.get(f"{base_url}/sim/state", timeout=5).json()


@pytest.fixture
def sim(procs) -> Callable[..., tuple[Proc, str]]:
    """`proc, url = sim("--preset", "cpu-tiny", ...)`: a sim worker stopped when the test ends."""
    return lambda *args, **kw: start_sim(procs, *args, **kw)
