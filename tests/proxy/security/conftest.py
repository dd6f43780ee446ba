"""The make_proxy fixture: in-process proxies for the control-plane tests (control_support.py), closed after."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp.test_utils import TestClient

from tests.proxy.security.control_support import start_proxy


@pytest.fixture
async def make_proxy() -> AsyncIterator[Callable[..., object]]:
    clients: list[TestClient] = []

    async def start(config_text: str = ""):
        return await start_proxy(clients, config_text)

    yield start
    for client in clients:
        await client.close()
