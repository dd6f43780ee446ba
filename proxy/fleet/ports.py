"""Free TCP ports for local workers, never handing the same one to two live replicas.

Owns only port choice; a port can still be taken by another program between the choice
and the worker's bind, which the supervisor treats like any crash (restart, new port).
"""

from __future__ import annotations

import socket


class PortAllocator:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._held: dict[str, int] = {}

    def allocate(self, owner: str) -> int:
        """A port that is free now and not held by another replica of this fleet."""
        self.release(owner)
        for _ in range(50):
            with socket.socket() as s:
                s.bind((self.host, 0))
                port = s.getsockname()[1]
            if port not in self._held.values():
                self._held[owner] = port
                return port
        raise OSError("no free port found")

    def release(self, owner: str) -> None:
        self._held.pop(owner, None)
