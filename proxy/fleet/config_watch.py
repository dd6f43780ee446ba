"""Watches the config file and hands each new valid version to the fleet manager.

Owns polling (mtime/size/inode every second, then a content hash, so a `touch` is not a change)
and reporting bad edits; it does not decide what a new config means (reconcile.py does).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.config import ConfigError, FleetConfig, parse_config
from proxy.fleet.gpus import GpuAssignmentError

log = logging.getLogger("kvroute.fleet")


class ConfigWatcher:
    def __init__(self, path: Path, apply: Callable[[FleetConfig], Any], interval_s: float = 1.0,
                 initial_text: str | None = None,
                 on_rejected: Callable[[str | None], Any] | None = None) -> None:
        """`on_rejected` hears "config edit rejected at HH:MM:SS: why" for a bad edit, and None once a
        later edit is applied (`kvroute up` shows it in `kvroute status` through the fleet manager)."""
        self.path = path
        self.apply = apply
        self.interval_s = interval_s
        self._stamp: tuple[int, int, int] | None = None  # mtime, size, inode (a rename is a new one)
        self._digest = hashlib.sha256(initial_text.encode()).hexdigest() if initial_text is not None else None
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # unix time of the rejected edit
        self.on_rejected = on_rejected
        self._task: asyncio.Task[None] | None = None

    def file_rewritten(self) -> None:
        """The fleet manager rewrote the file itself (`kvroute scale`): the next look applies whatever the file then
        holds, even a text seen before (an edit back to it within one poll would otherwise read as no change),
        and an edit made just before the rewrite, which the rewrite keeps, is applied too."""
        self._digest = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="config-watch")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        try:
            st = await asyncio.to_thread(os.stat, self.path)
            self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            self._stamp = None
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except Exception:  # never let one odd edit stop the watching
                log.exception("config watch failed")

    async def check(self) -> bool:
        """Look at the file once; True when a new config was applied."""
        try:
            st = await asyncio.to_thread(os.stat, self.path)
        except OSError:
            return False  # being replaced by an editor, or deleted: keep the fleet as it is
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            text = await asyncio.to_thread(self.path.read_text)
        except OSError:
            return False
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest == self._digest:
            return False
        self._digest = digest
        try:
            config = parse_config(text, source=str(self.path))
            plan = self.apply(config)
        except (ConfigError, GpuAssignmentError) as exc:
            self.last_error, self.last_error_at = str(exc), time.time()
            log.error("config change ignored, the fleet keeps running as it was: %s", exc)
            if self.on_rejected is not None:
                when = time.strftime("%H:%M:%S", time.localtime(self.last_error_at))
                self.on_rejected(f"config edit rejected at {when} (the fleet runs the previous version): {exc}")
            return False
        if self.last_error is not None and self.on_rejected is not None:
            self.on_rejected(None)
        self.last_error, self.last_error_at = None, None
        log.info("%s changed: %s", self.path, plan)
        return True
