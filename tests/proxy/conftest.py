"""Fixtures for proxy tests: `fleet` wraps `procs` with proxy/sim helpers."""

from __future__ import annotations

import pytest

from tests.proxy.fleet import Fleet


@pytest.fixture
def fleet(procs, tmp_path):
    f = Fleet(procs, tmp_path)
    yield f
    f.close()
