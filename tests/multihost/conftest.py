"""Fixtures for multi-host tests: four hosts (a, b, c, d) as network namespaces on a private bridge.

Owns the `net` fixture and the fleet helpers these tests share (support.py); not the namespaces
themselves (tests/support/netns.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.netns import Network, namespaces_error, network


@pytest.fixture(scope="session")
def _namespaces_allowed() -> None:
    why = namespaces_error()
    if why is not None:
        pytest.fail(why)  # real network namespaces are what these tests run on: forbidden here, they fail


@pytest.fixture
def net(procs, _namespaces_allowed) -> Iterator[Network]:
    """Hosts a, b, c, d at 10.203.0.2-5; the test process at 10.203.0.1. Torn down pass or fail."""
    with network(procs, ["a", "b", "c", "d"]) as n:
        yield n
