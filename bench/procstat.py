"""CPU time and resident memory of a process and its descendants, read from /proc (Linux only).

Owns only measurement; starting and stopping processes is peers.py's and fleet.py's job.
CPU counts utime+stime of every live descendant plus cutime/cstime of reaped children.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'
    return raw[raw.rindex(")") + 2:].split()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    """pid and all its live descendants."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += _children(p)
    return seen


@dataclass
class ProcessTree:
    """A process and its descendants; cpu_seconds() and rss_bytes() sum over the tree."""

    pid: int

    def cpu_seconds(self) -> float:
        total = 0
        for p in descendants(self.pid):
            f = _stat_fields(p)
            if f:  # fields after comm: state=0 ... utime=11 stime=12 cutime=13 cstime=14
                total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
        return total / CLK_TCK

    def rss_bytes(self) -> int:
        total = 0
        for p in descendants(self.pid):
            f = _stat_fields(p)
            if f:
                total += int(f[21]) * PAGE  # rss in pages
        return total
