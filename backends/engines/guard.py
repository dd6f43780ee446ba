"""A tiny reaper between the supervisor and an engine: no engine process outlives the supervisor.

Owns only process-tree cleanup; it knows nothing about engines. Why it exists: a parent-death
signal reaches one process, but vLLM's API server has its own children (EngineCore) that
survive when the API server is SIGKILLed. The guard gets PR_SET_PDEATHSIG=SIGTERM from the
supervisor, runs the engine in the engine's own process group, and whenever it ends (supervisor
gone, stop requested, engine died) takes that whole group down. Usage:
`python -m backends.engines.guard PARENT_PID GRACE_S -- CMD...` (the supervisor builds this).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
ENGINE_PID_LINE = "kvroute-guard: engine process group "
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def set_parent_death_signal(sig: int) -> None:
    """Linux prctl(PR_SET_PDEATHSIG): the kernel sends `sig` to this process when its parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))


def _engine_preexec() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    set_parent_death_signal(signal.SIGKILL)  # last resort should the guard itself be SIGKILLed


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    parent_pid, grace_s = int(argv[0]), float(argv[1])
    cmd = argv[3:] if argv[2:3] == ["--"] else argv[2:]
    # Hold stop signals until the handlers below exist, so none is lost between spawn and setup.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    if os.getppid() != parent_pid:  # the supervisor died before we started
        return 1
    engine = subprocess.Popen(cmd, process_group=0, preexec_fn=_engine_preexec)
    # The supervisor's last resort if this guard is SIGKILLed: it can still kill the engine's group.
    print(f"{ENGINE_PID_LINE}{engine.pid}", flush=True)

    def on_term(signum: int, frame: object) -> None:
        if os.getppid() != parent_pid:  # parent-death signal: no one will wait for a graceful stop
            _kill_group(engine.pid, signal.SIGKILL)
            return
        _kill_group(engine.pid, signal.SIGTERM)  # a stop request: let the engine finish cleanly...
        signal.alarm(max(int(grace_s), 1))  # ...but not forever

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGALRM, lambda *_: _kill_group(engine.pid, signal.SIGKILL))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    code = engine.wait()
    _kill_group(engine.pid, signal.SIGKILL)  # helpers the engine left behind (vLLM's EngineCore)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
