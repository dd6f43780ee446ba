"""The worker keeps draining its engine's output, whatever the engine prints."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from types import SimpleNamespace

import pytest

from backends.worker import Supervisor

pytestmark = pytest.mark.timeout(60)

# A stand-in engine: one 200 KB log line (vLLM logging a whole prompt), then more output than a pipe holds.
CHATTY_ENGINE = (
    "import sys\n"
    "sys.stdout.write('x' * 200_000 + '\\n')\n"
    "for i in range(5000):\n"
    "    print(f'filler line {i} ' + 'y' * 100)\n"
    "print('ENGINE-DONE', flush=True)\n"
)


async def test_a_log_line_over_64_kib_does_not_stop_the_relay(tmp_path):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHATTY_ENGINE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    seen: list[str] = []
    supervisor = SimpleNamespace(proc=proc, log_path=tmp_path / "engine.log", engine_pgid=None,
                                 adapter=SimpleNamespace(observe_log_line=seen.append))
    try:
        await asyncio.wait_for(Supervisor._relay_log(supervisor), 30)  # type: ignore[arg-type]
        assert await asyncio.wait_for(proc.wait(), 10) == 0  # the engine was never left blocked on a full pipe
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    text = (tmp_path / "engine.log").read_text()
    assert "over 64 KiB was dropped" in text and "filler line 4999" in text and "ENGINE-DONE" in text
    assert "ENGINE-DONE" in seen
