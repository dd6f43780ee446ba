"""Several "machines" on one Linux box: each host a network namespace on a private bridge (10.203.0.0/24).

Owns creating the hosts (veth pair, address, loopback), running commands on them through a
ProcessGroup, cutting and restoring a host's link, and tearing it all down (processes by PID,
then links, bridge, namespaces), also what a crashed earlier run left. Not what runs on them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.procs import KVROUTE, Proc, ProcessGroup

SUBNET_PREFIX = "10.203.0."
ROOT_ADDRESS = SUBNET_PREFIX + "1"  # the test process's own address on the bridge
PREFIX = "kvrt"  # every namespace, bridge and veth this module creates starts with this
LOCK_PATH = Path("/tmp/kvroute-netns.lock")


class NamespacesUnavailable(RuntimeError):
    """The kernel (or the container) does not let this process create network namespaces."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def namespace_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit() and int(p) != os.getpid()]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process living in `ns` (by PID), and wait until none is left."""
    deadline = time.monotonic() + 10
    while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_ours(run_id: str | None = None) -> None:
    """Delete namespaces and links named after this module (one run's, or all: a crashed run's leftovers)."""
    prefix = f"{PREFIX}{run_id}" if run_id else PREFIX
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(prefix):
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                _ip("link", "del", name, check=False)


def check_namespaces_allowed() -> None:
    """Raise NamespacesUnavailable when the kernel forbids network namespaces here (tried once)."""
    probe = f"{PREFIX}probe{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        err = result.stderr.strip()
        if "Operation not permitted" in err or "Permission denied" in err or os.geteuid() != 0:
            raise NamespacesUnavailable(f"network namespaces are not permitted here (`ip netns add`: {err})")
        raise RuntimeError(f"ip netns add failed: {err}")
    _ip("netns", "del", probe, check=False)


@dataclass
class Host:
    """One emulated machine: a namespace with one interface (eth0) on the bridge."""

    name: str  # short test-facing name: a, b, c, ...
    ns: str
    address: str
    bridge_port: str  # the veth end in the root namespace, plugged into the bridge
    net: Network
    procs: list[Proc] = field(default_factory=list)
    killed_at: float | None = None  # time.monotonic() of the last kill_all

    def url(self, port: int) -> str:
        return f"http://{self.address}:{port}"

    def exec_argv(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def start(self, args: list[str], name: str = "proc", env: dict[str, str] | None = None) -> Proc:
        """Run `args` on this host (a process recorded by PID in the test's ProcessGroup)."""
        proc = self.net.group.start(self.exec_argv(args), name=f"{self.name}-{name}", env=env)
        self.procs.append(proc)
        return proc

    def kvroute(self, *args: str, name: str = "kvroute", env: dict[str, str] | None = None) -> Proc:
        return self.start([*KVROUTE, *args], name=name, env=env)

    def run(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a short command on this host and wait for it."""
        return subprocess.run(self.exec_argv(args), capture_output=True, text=True, timeout=timeout)

    def link_down(self) -> None:
        """Pull the cable: the host stays up, its packets and those sent to it are dropped silently."""
        _ip("link", "set", self.bridge_port, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.bridge_port, "up")

    def pids(self) -> list[int]:
        return namespace_pids(self.ns)

    def kill_all(self) -> list[int]:
        """The machine dies: SIGKILL every process on it at once. Returns the PIDs killed."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.killed_at = time.monotonic()  # listing the PIDs takes a while: this is when they died
        for proc in self.procs:  # reap, so the test's Proc objects see them dead
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)
        return pids


class Network:
    """N hosts on one bridge; the root namespace (the test) is at 10.203.0.1 on it."""

    def __init__(self, group: ProcessGroup, names: list[str]) -> None:
        if len(names) > 200:
            raise ValueError("at most 200 hosts")
        self.group = group
        self.run_id = secrets.token_hex(3)
        self.bridge = f"{PREFIX}{self.run_id}br"
        self.hosts: dict[str, Host] = {}
        self._lock_fd: int | None = None
        self._names = names

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def up(self) -> Network:
        # One run at a time owns 10.203.0.0/24 on this machine; whatever another run left is stale.
        self._lock_fd = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        _delete_ours()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{ROOT_ADDRESS}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self._names):
            ns = f"{PREFIX}{self.run_id}-{name}"
            port, inner = f"{PREFIX}{self.run_id}{i}", f"{PREFIX}{self.run_id}{i}i"
            address = f"{SUBNET_PREFIX}{i + 2}"
            _ip("netns", "add", ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", port, "master", self.bridge)
            _ip("link", "set", port, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            # A default route without a gateway: tools that find "their" address by routing towards the
            # internet (Ray) see eth0's, while a packet for anything off the bridge only ARPs unanswered.
            _ip("-n", ns, "route", "add", "default", "dev", "eth0")
            self.hosts[name] = Host(name, ns, address, port, self)
        return self

    def down(self) -> None:
        """Processes by PID, then links and namespaces; safe after a partial `up`."""
        try:
            for host in self.hosts.values():
                for proc in reversed(host.procs):
                    proc.stop(timeout=5)
                _kill_namespace_processes(host.ns)  # what the commands started outside their group (Ray)
            _delete_ours(self.run_id)
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None


@contextlib.contextmanager
def network(group: ProcessGroup, names: list[str]) -> Iterator[Network]:
    net = Network(group, names)
    try:
        yield net.up()
    finally:
        net.down()


def namespaces_error() -> str | None:
    """None where namespaces work; otherwise why not (the text a test fails with)."""
    try:
        check_namespaces_allowed()
    except NamespacesUnavailable as exc:
        return str(exc)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            return f"network namespaces are not available here: {exc}"
        raise
    return None
