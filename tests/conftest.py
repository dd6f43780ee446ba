"""Fixtures shared by all tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.support.fleet import Fleet
from tests.support.procs import ProcessGroup, free_port, wait_until

# `kvroute proxy` and `kvroute up` write the admin token they make to a 0600 file in this folder; tests read
# it there (tests.support.procs.admin_headers), and never leave files in the user's ~/.config.
os.environ.setdefault("KVROUTE_CONFIG_DIR", tempfile.mkdtemp(prefix="kvroute-test-config-"))


@pytest.fixture
def procs(tmp_path, request) -> Iterator[ProcessGroup]:
    """Start processes with `procs.start(...)`; all are stopped by PID when the test ends."""
    group = ProcessGroup(tmp_path)
    yield group
    reports = (getattr(request.node, "rep_setup", None), getattr(request.node, "rep_call", None))
    if any(r is not None and r.failed for r in reports):
        print(group.logs())
    group.stop_all()


# Tests that must not run beside each other under `pytest -n` (make test runs two xdist workers, --dist
# loadgroup): network namespaces share one bridge and address range, and a Ray cluster or a second real
# vLLM next to them starves both on two cores. Every other test is grouped by its file, so a module's
# fixture (a real vLLM fleet, say) is built once, on one worker.
EXCLUSIVE = ("tests/multihost/", "tests/e2e/vllm/", "tests/fleet/test_ray.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads xdist_group into the node ids
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "exclusive" if path.startswith(EXCLUSIVE) else path
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.fixture
def fleet(procs, tmp_path):
    """`procs` with proxy and sim helpers (tests/support/fleet.py)."""
    f = Fleet(procs, tmp_path)
    yield f
    f.close()


@pytest.fixture
def redis_url(procs):
    # `make test` installs redis-server (Makefile: system-deps); a missing one is a failed setup, not a skip.
    assert shutil.which("redis-server"), "redis-server is not installed: run `make test` (it installs it)"
    port = free_port()
    procs.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                name="redis")
    wait_until(lambda: _redis_ping(port), 15, what="redis-server to answer")
    return f"redis://127.0.0.1:{port}/0"


def _redis_ping(port: int) -> bool:
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    finally:
        client.close()
