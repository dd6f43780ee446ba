"""Bytes of request bodies the data plane holds at once, all connections together
(proxy.limits.max_buffered_body_bytes).

Owns the budget and its FIFO of connections waiting for room, each for at most `wait_s` with its reading
paused; what a waiting connection does when room comes or time runs out is connection.py's, told through
the BudgetWaiter protocol.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol


class BudgetWaiter(Protocol):
    """What the budget needs of a connection waiting for room (connection.py's ClientConnection)."""

    loop: asyncio.AbstractEventLoop
    budget_need: int  # the bytes it waits for

    def budget_granted(self) -> None: ...

    def budget_timed_out(self) -> None: ...


class BodyBudget:
    """A body that does not fit waits, FIFO, up to `wait_s` with its connection's reading paused; then 503."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self.waiting: deque[tuple[BudgetWaiter, asyncio.TimerHandle]] = deque()

    def take(self, nbytes: int) -> bool:
        nbytes = min(nbytes, self.capacity)
        if self.waiting or self.held + nbytes > self.capacity:
            return False
        self.held += nbytes
        return True

    def wait(self, conn: BudgetWaiter) -> None:
        timer = conn.loop.call_later(self.wait_s, self._timed_out, conn)
        self.waiting.append((conn, timer))

    def give_back(self, nbytes: int) -> None:
        self.held -= min(nbytes, self.capacity)
        while self.waiting:
            conn, timer = self.waiting[0]
            need = min(conn.budget_need, self.capacity)
            if self.held + need > self.capacity:
                return
            self.waiting.popleft()
            timer.cancel()
            self.held += need
            conn.budget_granted()

    def forget(self, conn: BudgetWaiter) -> None:
        for entry in list(self.waiting):
            if entry[0] is conn:
                entry[1].cancel()
                self.waiting.remove(entry)

    def _timed_out(self, conn: BudgetWaiter) -> None:
        self.forget(conn)
        conn.budget_timed_out()
