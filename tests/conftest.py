"""Fixtures shared by all tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.procs import ProcessGroup


@pytest.fixture
def procs(tmp_path, request) -> Iterator[ProcessGroup]:
    """Start processes with `procs.start(...)`; all are stopped by PID when the test ends."""
    group = ProcessGroup(tmp_path)
    yield group
    reports = (getattr(request.node, "rep_setup", None), getattr(request.node, "rep_call", None))
    if any(r is not None and r.failed for r in reports):
        print(group.logs())
    group.stop_all()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
