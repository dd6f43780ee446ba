"""Which client connections the public port lets in, and how long an idle one may stay.

Owns the total cap (proxy.limits.max_client_connections), the cap per client address
(max_connections_per_client, an IPv6 client counted by its /64), the short keep-alive while the proxy
is busy (past half its cap, or short of file descriptors), and pausing accepts while file descriptors
run short, with RLIMIT_NOFILE raised to its hard limit at start. The listening sockets are server.py's,
told through the Listener protocol; one connection's HTTP is connection.py's, told through Guarded.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import resource
from typing import Protocol

from proxy.config import ProxyLimits
from proxy.observability.metrics import ProxyMetrics

log = logging.getLogger("kvroute.dataplane")

# An idle keep-alive connection is closed after this long (nginx's and aiohttp's default is 75 s)...
KEEPALIVE_S = 75.0
# ...and after this long while the proxy is busy: an idle connection then holds room a new client needs.
BUSY_KEEPALIVE_S = 2.0
# Busy: more connections open than this share of max_client_connections; no longer busy below the second.
BUSY_SHARE, CALM_SHARE = 0.5, 0.4
# Accepting pauses when an accepted socket's descriptor number comes this near the process's limit (the
# kernel hands out the lowest free number, so every one below it is in use), and resumes once fewer than
# twice as many below the limit are open: upstream connections and files need descriptors too.
FD_RESERVE_SHARE, FD_RESERVE_MIN = 0.1, 32
FD_CHECK_S = 0.5
# One warning per reason at most this often: a flood of refusals must not flood the log.
WARN_EVERY_S = 10.0


class Listener(Protocol):
    """What the gate needs of the server that owns the listening sockets (server.py's DataPlane)."""

    def pause_accepting(self) -> None: ...

    def resume_accepting(self) -> None: ...


class Guarded(Protocol):
    """A client connection as the gate sees it (connection.py's ClientConnection)."""

    def keepalive_changed(self) -> None:
        """The idle deadline changed: re-arm it if the connection is idle."""
        ...

    def abort(self) -> None:
        """Close at once (the server, when it stops)."""
        ...


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit where the OS allows; the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def client_key(peer: bytes) -> bytes:
    """Whose connection this is, for the per-client cap: the IPv4 address, or an IPv6 address's /64 (one
    host gets a /64 to choose addresses from)."""
    if b":" not in peer:
        return peer
    try:
        address = ipaddress.IPv6Address(peer.decode("ascii").split("%", 1)[0])
    except ValueError:
        return peer
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped).encode()
    return b"%x/64" % (int(address) >> 64)


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: not Linux
        return None


class ConnectionGate:
    """Admits client connections and says how long an idle one may stay open."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: ProxyLimits, metrics: ProxyMetrics,
                 listener: Listener) -> None:
        self.loop = loop
        self.max_total = limits.max_client_connections
        self.max_per_client = limits.max_connections_per_client
        self.metrics = metrics
        self.listener = listener
        self.connections: set[Guarded] = set()
        self.per_client: dict[bytes, int] = {}
        self.busy = False
        self.keepalive_s = KEEPALIVE_S
        self.paused_since: float | None = None
        self.warned: dict[str, float] = {}
        self.fd_limit = raise_fd_limit()
        self.fd_reserve = max(FD_RESERVE_MIN, int(self.fd_limit * FD_RESERVE_SHARE))
        if self.fd_limit - self.fd_reserve < 2 * self.max_total:
            log.info("open-file limit %d: accepting pauses near %d descriptors, before max_client_connections "
                     "(%d, each with its upstream connection) could be reached", self.fd_limit,
                     self.fd_limit - self.fd_reserve, self.max_total)
        metrics.client_connections.set_function(lambda: len(self.connections))
        metrics.accepting.set(1)

    # --- one connection -----------------------------------------------------------------------------
    def admit(self, conn: Guarded, key: bytes, fd: int) -> str | None:
        """Let `conn` (from client `key`, on descriptor `fd`) in: None; else the cap it is over."""
        if fd >= self.fd_limit - self.fd_reserve and self.paused_since is None:
            self._pause(fd)
        if len(self.connections) >= self.max_total:
            return self._refused("total_cap")
        held = self.per_client.get(key, 0)
        if held >= self.max_per_client:
            return self._refused("per_client_cap", key)
        self.per_client[key] = held + 1
        self.connections.add(conn)
        if not self.busy and len(self.connections) > self.max_total * BUSY_SHARE:
            self._set_busy(True)
        return None

    def release(self, conn: Guarded, key: bytes) -> None:
        self.connections.discard(conn)
        held = self.per_client.get(key, 0) - 1
        if held > 0:
            self.per_client[key] = held
        else:
            self.per_client.pop(key, None)
        if self.busy and self.paused_since is None and len(self.connections) < self.max_total * CALM_SHARE:
            self._set_busy(False)

    def shed_idle(self) -> None:
        """An idle connection was closed early because the proxy is busy."""
        self.metrics.connections_shed.labels("idle_under_pressure").inc()

    # --- busy: short keep-alive ------------------------------------------------------------------
    def _set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.keepalive_s = BUSY_KEEPALIVE_S if busy else KEEPALIVE_S
        if busy:
            self._warn("busy", "%d client connections open (max_client_connections %d): idle ones are closed "
                               "after %gs", len(self.connections), self.max_total, BUSY_KEEPALIVE_S)
            for conn in list(self.connections):  # their idle timers were armed for the long keep-alive
                conn.keepalive_changed()

    # --- file descriptors: pause accepting ----------------------------------------------------------
    def _pause(self, fd: int) -> None:
        self.paused_since = self.loop.time()
        self.listener.pause_accepting()
        self.metrics.accept_pauses.inc()
        self.metrics.accepting.set(0)
        log.warning("file descriptors near the process limit (descriptor %d of %d): accepting new connections "
                    "paused until some close; idle connections are closed after %gs meanwhile", fd,
                    self.fd_limit, BUSY_KEEPALIVE_S)
        if not self.busy:
            self._set_busy(True)
        self.loop.call_later(FD_CHECK_S, self._check_fds)

    def _check_fds(self) -> None:
        if self.paused_since is None:
            return
        open_fds = _open_fds()
        if open_fds is not None and open_fds > self.fd_limit - 2 * self.fd_reserve:
            self.loop.call_later(FD_CHECK_S, self._check_fds)
            return
        log.warning("accepting new connections again after %.1fs (%s descriptors open)",
                    self.loop.time() - self.paused_since, open_fds if open_fds is not None else "?")
        self.paused_since = None
        self.metrics.accepting.set(1)
        self.listener.resume_accepting()
        if len(self.connections) < self.max_total * CALM_SHARE:
            self._set_busy(False)

    # --- refusals -------------------------------------------------------------------------------
    def _refused(self, reason: str, key: bytes = b"") -> str:
        self.metrics.connections_shed.labels(reason).inc()
        if reason == "total_cap":
            self._warn(reason, "max_client_connections (%d) reached: new connections are refused", self.max_total)
        else:
            self._warn(reason, "client %s has max_connections_per_client (%d) open: its new connections are "
                               "refused", key.decode("latin-1"), self.max_per_client)
        return reason

    def _warn(self, reason: str, message: str, *args: object) -> None:
        now = self.loop.time()
        if now - self.warned.get(reason, -WARN_EVERY_S) >= WARN_EVERY_S:
            self.warned[reason] = now
            log.warning(message, *args)
