"""Which GPUs a fleet may use and which replica gets which: detection plus pure assignment logic.

Owns GPU discovery (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`) and the allocation of
contiguous, non-overlapping GPU groups; it does not start processes.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class GpuAssignmentError(ValueError):
    """The fleet (or one more replica) does not fit on the GPUs that are free."""


@dataclass(frozen=True)
class GpuDemand:
    """What one model asks for: `replicas` groups of `gpus_per_replica` GPUs each."""

    model: str
    replicas: int
    gpus_per_replica: int


def parse_cuda_visible_devices(value: str) -> list[str]:
    """CUDA's own rule: ids up to the first invalid one ("-1" hides every GPU); UUIDs pass through."""
    gpus: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if not item or item.startswith("-") or item.lower() == "nodevfiles":
            break
        gpus.append(item)
    return gpus


_SMI_LINE = re.compile(r"^GPU (\d+):")


def parse_nvidia_smi_listing(text: str) -> list[str]:
    """`nvidia-smi -L` lines ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)") -> ["0", ...].

    MIG instances listed under a GPU are indented and not counted: a replica gets whole GPUs.
    """
    return [m.group(1) for line in text.splitlines() if (m := _SMI_LINE.match(line))]


async def detect_gpus(env: Mapping[str, str]) -> tuple[list[str], str]:
    """The GPUs this machine offers the fleet, and where that list came from (for messages)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return parse_cuda_visible_devices(env["CUDA_VISIBLE_DEVICES"]), \
            f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no CUDA_VISIBLE_DEVICES and no nvidia-smi"
    try:
        proc = await asyncio.create_subprocess_exec(smi, "-L", stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=20)
    except (OSError, TimeoutError):
        return [], "nvidia-smi -L failed"
    return parse_nvidia_smi_listing(out.decode(errors="replace")), "nvidia-smi -L"


class GpuPool:
    """The GPUs one fleet may use, and who holds each.

    A replica's GPUs are a contiguous run of the visible list, aligned to its size when
    possible (2-GPU groups on 0-1, 2-3, ...; 4-GPU groups on 0-3, 4-7), because on NVLink
    boxes neighbouring ids share the fast links that tensor parallelism needs.
    """

    def __init__(self, gpus: Iterable[str], source: str = "") -> None:
        self.gpus = list(gpus)
        if len(set(self.gpus)) != len(self.gpus):
            raise GpuAssignmentError(f"GPU list has duplicates: {self.gpus}")
        self.source = source
        self._holder: dict[str, str | None] = dict.fromkeys(self.gpus)

    def free(self) -> list[str]:
        return [g for g in self.gpus if self._holder[g] is None]

    def held_by(self, owner: str) -> list[str]:
        return [g for g in self.gpus if self._holder[g] == owner]

    def _find_block(self, count: int) -> int | None:
        runs = [i for i in range(len(self.gpus) - count + 1)
                if all(self._holder[g] is None for g in self.gpus[i:i + count])]
        aligned = [i for i in runs if i % count == 0]
        return (aligned or runs or [None])[0]

    def can_allocate(self, counts: Iterable[int]) -> bool:
        """Would these groups fit, given what is held now (largest first, as allocate_many does)?"""
        trial = GpuPool(self.gpus)
        trial._holder = dict(self._holder)
        try:
            for i, count in enumerate(sorted(counts, reverse=True)):
                trial.allocate(count, f"?{i}")
        except GpuAssignmentError:
            return False
        return True

    def allocate(self, count: int, owner: str) -> list[str]:
        """Give `owner` `count` contiguous free GPUs, or raise GpuAssignmentError saying why not."""
        if count <= 0:
            return []
        if self.held_by(owner):
            raise GpuAssignmentError(f"{owner} already holds GPUs {self.held_by(owner)}")
        start = self._find_block(count)
        if start is None:
            free = self.free()
            where = f" ({self.source})" if self.source else ""
            if len(free) >= count:
                raise GpuAssignmentError(
                    f"{owner} needs {count} adjacent GPUs for tensor parallelism; free GPUs {free} are not "
                    f"adjacent{where}")
            raise GpuAssignmentError(f"{owner} needs {count} GPU(s) but only {len(free)} of {len(self.gpus)} "
                                     f"are free{where}")
        block = self.gpus[start:start + count]
        for g in block:
            self._holder[g] = owner
        return block

    def release(self, owner: str) -> None:
        for g in self.gpus:
            if self._holder[g] == owner:
                self._holder[g] = None


def plan_assignment(demands: list[GpuDemand], gpus: list[str], source: str = "") -> dict[str, list[list[str]]]:
    """Assign GPU groups to every replica of every model: {model: [[gpus of replica 0], ...]}.

    Largest groups are placed first so that size-aligned blocks never get fragmented by
    single-GPU replicas. Raises GpuAssignmentError with the whole fleet's arithmetic when
    it does not fit.
    """
    needed = sum(d.replicas * d.gpus_per_replica for d in demands)
    where = f" ({source})" if source else ""
    if needed > len(gpus):
        parts = ", ".join(f"{d.model}: {d.replicas} x {d.gpus_per_replica}" for d in demands
                          if d.replicas and d.gpus_per_replica)
        raise GpuAssignmentError(f"the fleet needs {needed} GPUs ({parts}) but {len(gpus)} are available"
                                 f"{where}{': ' + ','.join(gpus) if gpus else ''}")
    pool = GpuPool(gpus, source)
    order = sorted(((d, i) for d in demands for i in range(d.replicas)),
                   key=lambda di: -di[0].gpus_per_replica)
    plan: dict[str, list[list[str]]] = {d.model: [[] for _ in range(d.replicas)] for d in demands}
    for d, i in order:
        plan[d.model][i] = pool.allocate(d.gpus_per_replica, f"{d.model}[{i}]")
    return plan
