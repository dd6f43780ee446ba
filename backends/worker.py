"""`kvroute worker --engine vllm|turbomind`: the supervisor around one engine's own OpenAI server.

Owns the engine process's lifecycle (start, readiness, death, drain, stop) and wires its load
into backends.reporter.ProxyReporter; how to launch and read each engine lives in backends/engines/.

Port layout: the engine itself listens on --port (or --engine-port when given) and the proxy
forwards straight to it, so every OpenAI feature of the engine is kept; the supervisor serves no
HTTP. It reads the engine's /metrics on loopback at the report rate.

Orphans: the engine runs under backends/engines/guard.py, which has PR_SET_PDEATHSIG and takes
the engine's whole process group (vLLM's EngineCore included) down when the supervisor dies,
even by SIGKILL, when a stop is requested, or when the engine itself dies. The engine's output is kept in a log file (KVROUTE_LOG_DIR, default the
temp dir) and relayed to the supervisor's stdout, prefixed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from backends import tokenizer_handover
from backends.address import advertise_url
from backends.engines.base import EngineAdapter, EngineLaunch
from backends.engines.guard import ENGINE_PID_LINE, set_parent_death_signal
from backends.kv_subscriber import EngineKvFeed
from backends.reporter import Load, ProxyReporter, parse_proxy_urls
from backends.roles import role_labels, transfer_flag
from proxy.protocol import WorkerRegistration
from proxy.security.redact import redact_argv, redact_text

log = logging.getLogger("kvroute.worker")
ENGINE_STOP_GRACE_S = 15.0


# How each engine takes the key its OpenAI server then demands (Authorization: Bearer KEY) on /v1/*.
# vLLM also reads VLLM_API_KEY, which keeps the key out of `ps`; LMDeploy has only the flag.
_API_KEY_FLAGS = {"vllm": "--api-key", "turbomind": "--api-keys"}
_API_KEY_ENV = {"vllm": "VLLM_API_KEY"}


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def engine_api_key(family: str, engine_args: list[str], env: dict[str, str]) -> tuple[str, list[str], dict[str, str]]:
    """The key the engine will demand, and the extra argv / environment that set it.

    A key the operator gave (engine args, or VLLM_API_KEY) is kept; otherwise a random one per replica,
    so nothing on the host reaches the engine around the proxy, which learns it at registration.
    """
    flag, env_name = _API_KEY_FLAGS.get(family), _API_KEY_ENV.get(family)
    given = (_flag_value(engine_args, flag) if flag else None) or (env.get(env_name) if env_name else None)
    if given:
        return given, [], {}
    key = secrets.token_urlsafe(24)
    if env_name:
        return key, [], {env_name: key}
    return key, [flag, key] if flag else [], {}


class EngineFailed(RuntimeError):
    """The engine exited, or never became ready."""


def make_adapter(engine: str) -> EngineAdapter:
    if engine == "vllm":
        from backends.engines.vllm import VllmAdapter
        return VllmAdapter()
    if engine == "turbomind":
        from backends.engines.turbomind import TurbomindAdapter
        return TurbomindAdapter()
    raise ValueError(f"no supervisor for engine {engine!r}")


def _guard_preexec(parent_pid: int) -> None:
    """preexec_fn of the guard: its own process group, and SIGTERM when the supervisor dies."""
    os.setpgid(0, 0)
    set_parent_death_signal(signal.SIGTERM)  # the guard then SIGKILLs the engine's whole group
    if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
        os._exit(1)


async def _read_log_line(stream: asyncio.StreamReader) -> bytes:
    """The next line of engine output; b"" at the end. asyncio drops a line over the reader's 64 KiB
    limit (vLLM can log whole prompts) and raises; a relay that died of it would stop draining the
    pipe, and the engine would block on its next write. So say what was dropped and go on."""
    try:
        return await stream.readline()
    except ValueError:
        return b"[kvroute: an engine log line over 64 KiB was dropped]\n"


async def spawn_guarded(cmd: list[str], env: dict[str, str], stop_grace_s: float) -> asyncio.subprocess.Process:
    """Start `cmd` under backends.engines.guard; returns the guard process (stdout piped, stderr merged)."""
    parent = os.getpid()
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backends.engines.guard", str(parent), str(stop_grace_s), "--", *cmd,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env, preexec_fn=lambda: _guard_preexec(parent))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "::") else "127.0.0.1", 0))
        return s.getsockname()[1]


def launch_from_args(args: argparse.Namespace) -> EngineLaunch:
    if not args.model:
        raise SystemExit("kvroute worker: --model is required for --engine vllm|turbomind")
    gpus = [g.strip() for g in (args.gpus or "").split(",") if g.strip()]
    port = args.engine_port or args.port or _free_port(args.host)
    return EngineLaunch(
        model=args.model, served_model_name=args.served_model_name or Path(args.model.rstrip("/")).name,
        host=args.host, port=port, device=args.device or ("cuda" if gpus else "cpu"), gpus=gpus,
        engine_args=list(args.engine_args or []), role=args.role,
        kv_transfer=transfer_flag(args.kv_transfer, "--kv-transfer"),
        ec_transfer=transfer_flag(args.ec_transfer, "--ec-transfer"),
    )


class Supervisor:
    """Runs one engine and keeps the proxy told about it; `run()` returns the exit code."""

    def __init__(self, args: argparse.Namespace, adapter: EngineAdapter, launch: EngineLaunch) -> None:
        self.args = args
        self.adapter = adapter
        self.launch = launch
        loopback = "127.0.0.1" if launch.host in ("0.0.0.0", "::", "") else launch.host
        self.local_url = f"http://{loopback}:{launch.port}"
        self.advertise_url = advertise_url(args.advertise_url, launch.host, launch.port,
                                           parse_proxy_urls(args.proxy_url))
        launch.advertise_host = urlsplit(self.advertise_url).hostname  # where other pools reach its KV
        log_dir = Path(os.environ.get("KVROUTE_LOG_DIR", tempfile.gettempdir()))
        self.log_path = log_dir / f"kvroute-engine-{adapter.family}-{launch.port}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.engine_pgid: int | None = None  # announced by the guard
        self.reporter: ProxyReporter | None = None
        self.session: aiohttp.ClientSession | None = None
        self.stop_requested = asyncio.Event()
        self.last_load = Load(0.0, 0, 0)
        self.api_key: str | None = None  # the engine's own key, chosen at start
        self.kv_feed: EngineKvFeed | None = None  # the engine's KV events, forwarded in the reports

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        started = time.monotonic()
        try:
            await self._start_engine()  # also opens self.session, which carries the engine's key
            exited = asyncio.create_task(self._guard_exit())
            await self._wait_ready(exited)
            log.info("engine %s ready at %s after %.1fs (log: %s)", self.adapter.running_engine,
                     self.local_url, time.monotonic() - started, self.log_path)
            await self._register()
            if self.reporter:
                await self.reporter.registered.wait()
                log.info("registered with %s as %s %.1fs after start", redact_text(self.args.proxy_url),
                         self.reporter.worker_id, time.monotonic() - started)
            stop = asyncio.create_task(self.stop_requested.wait())
            await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
            if exited.done():
                raise EngineFailed(f"engine exited with code {exited.result()}")
            await self._drain()
            return 0
        except EngineFailed as exc:
            log.error("%s; engine log: %s", exc, self.log_path)
            if self.reporter and self.reporter.registered.is_set():
                await self.reporter.set_state("failed")
                log.error("reported state 'failed' to %s", redact_text(self.args.proxy_url))
            return 1
        finally:
            await self._stop_engine()
            if self.kv_feed is not None:
                await self.kv_feed.stop()
            if self.reporter:
                # A failed worker stays listed (as failed) until the proxy ages it out; a drained one leaves.
                await self.reporter.stop(deregister=not self.reporter.state == "failed")
            if self.session is not None:
                await self.session.close()

    async def _start_engine(self) -> None:
        env = self.adapter.environment(self.launch, os.environ)
        forward = self.args.proxy_url and not self.args.no_kv_events
        scheme = self.adapter.kv_event_scheme(self.launch, env) if forward else None
        if scheme is not None:  # subscribed before the engine starts: it publishes from its first request
            self.kv_feed = EngineKvFeed(*scheme)
            await self.kv_feed.start()
            self.launch.kv_events = self.kv_feed.engine_config()
        cmd = self.adapter.command(self.launch)
        self.api_key, extra_args, extra_env = engine_api_key(self.adapter.family, list(self.launch.engine_args), env)
        cmd, env = cmd + extra_args, {**env, **extra_env}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5, connect=2),
                                             headers={"Authorization": f"Bearer {self.api_key}"})
        log.info("starting engine: %s", " ".join(redact_argv(cmd)))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = await spawn_guarded(cmd, env, ENGINE_STOP_GRACE_S)
        asyncio.create_task(self._relay_log(), name="engine-log")

    async def _guard_exit(self) -> int:
        """The guard's exit code. Not `proc.wait()`: that also waits for the stdout pipe to close,
        which an orphaned engine helper could hold open forever."""
        assert self.proc
        while self.proc.returncode is None:  # noqa: ASYNC110 -- no event fires before the pipe closes
            await asyncio.sleep(0.2)
        return self.proc.returncode

    async def _relay_log(self) -> None:
        assert self.proc and self.proc.stdout
        # Opening may touch a slow disk: off the loop. The writes are small buffered appends.
        log_file = await asyncio.to_thread(open, self.log_path, "ab", 64 * 1024)
        with log_file:
            while line := await _read_log_line(self.proc.stdout):
                text = line.decode(errors="replace").rstrip()
                # engines print their arguments at start-up (vLLM: `non-default args: {'api_key': [...]}`)
                shown = redact_text(text)
                log_file.write(line if shown == text else shown.encode() + b"\n")
                if self.engine_pgid is None and text.startswith(ENGINE_PID_LINE):
                    self.engine_pgid = int(text[len(ENGINE_PID_LINE):])
                self.adapter.observe_log_line(text)
                print(f"[engine] {shown}", flush=False)
                log_file.flush()
        sys.stdout.flush()

    async def _wait_ready(self, exited: asyncio.Task[int]) -> None:
        assert self.session
        deadline = time.monotonic() + self.args.startup_timeout_s
        while time.monotonic() < deadline:
            if exited.done():
                raise EngineFailed(f"engine exited with code {exited.result()} before it was ready")
            if self.stop_requested.is_set():
                raise EngineFailed("stopped before the engine was ready")
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                async with self.session.get(self.local_url + self.adapter.ready_path) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)
        raise EngineFailed(f"engine not ready after {self.args.startup_timeout_s:.0f}s")

    async def read_load(self) -> Load:
        """The engine's load now; an empty load once the engine is gone, so a 'failed' report still goes out."""
        assert self.session
        try:
            self.last_load = await self.adapter.read_load(self.session, self.local_url)
            if self.kv_feed is not None:
                self.kv_feed.capacity_from(self.last_load.kv_capacity_tokens, self.last_load.kv_block_size)
        except (TimeoutError, aiohttp.ClientError):
            if self.proc is None or self.proc.returncode is None:
                raise
            self.last_load = Load(0.0, 0, 0, kv_capacity_tokens=self.last_load.kv_capacity_tokens)
        return self.last_load

    async def _register(self) -> None:
        if not self.args.proxy_url:
            log.info("no --proxy-url: running standalone")
            return
        first = await self.read_load()
        registration = WorkerRegistration(
            max_model_len=await self._max_model_len(),
            worker_id=self.args.worker_id, url=self.advertise_url, models=[self.launch.served_model_name],
            engine=self.adapter.running_engine,  # type: ignore[arg-type]
            kv_capacity_tokens=first.kv_capacity_tokens, gpus=self.launch.gpus,
            labels={"device": self.launch.device, "engine_family": self.adapter.family,
                    **role_labels(self.launch.kv_transfer)},
            api_key=self.api_key, role=self.launch.role,  # type: ignore[arg-type]  # cmd_worker's choices
        )
        # vLLM counts prompts with the checkpoint's tokenizer and template, which the proxy then uses as well
        handover = (await tokenizer_handover.for_vllm(self.launch.model, self.launch.engine_args)
                    if self.adapter.family == "vllm" else None)
        self.reporter = ProxyReporter(self.args.proxy_url, registration, self.read_load, token=self.args.proxy_token,
                                      kv_events=self.kv_feed.mirror if self.kv_feed is not None else None,
                                      on_registered=handover)
        await self.reporter.start()

    async def _max_model_len(self) -> int | None:
        """vLLM lists max_model_len in /v1/models (LMDeploy does not): the proxy can then refuse
        prompts that cannot fit before they reach the engine."""
        assert self.session
        try:
            async with self.session.get(self.local_url + "/v1/models") as resp:
                models = (await resp.json()).get("data") or [{}]
            value = models[0].get("max_model_len")
            return int(value) if value else None
        except (TimeoutError, aiohttp.ClientError, ValueError, TypeError, AttributeError):
            return None

    async def _drain(self) -> None:
        """Tell the proxy we drain, then wait (bounded) until the engine has nothing in flight.

        "Nothing" must hold on two reads in a row: a request can sit between the proxy and the
        engine's scheduler for a moment. A read that fails (a busy host) is retried, not taken as idle.
        """
        log.info("draining (grace %.0fs)", self.args.drain_grace_s)
        if self.reporter and self.reporter.registered.is_set():
            await self.reporter.set_state("draining")
        deadline = time.monotonic() + self.args.drain_grace_s
        idle_reads = 0
        while time.monotonic() < deadline and self.proc and self.proc.returncode is None:
            busy = await self._busy_requests()
            idle_reads = idle_reads + 1 if busy == 0 else 0
            if idle_reads >= 2:
                return
            await asyncio.sleep(0.25)
        if self.proc and self.proc.returncode is None:
            log.warning("drain grace over; stopping the engine with work in flight")

    async def _busy_requests(self) -> int | None:
        """Requests the engine still has: the larger of its HTTP in-flight count (if it keeps one) and
        its scheduler's running + waiting; None when neither can be read."""
        assert self.session
        try:
            load = await self.adapter.read_load(self.session, self.local_url)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        busy = load.num_running + load.num_waiting
        try:
            in_http = await self.adapter.in_flight(self.session, self.local_url)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            in_http = None
        # vLLM's counter can drift below zero after aborted requests; then it says nothing useful.
        return max(busy, in_http) if in_http is not None and in_http >= 0 else busy

    async def _stop_engine(self) -> None:
        """SIGTERM the guard: it stops the engine group (SIGKILL after the grace) and exits."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._guard_exit(), ENGINE_STOP_GRACE_S + 5)
            except TimeoutError:
                log.warning("engine guard did not exit; killing it")
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await self._guard_exit()
        if self.engine_pgid is not None:  # normally gone already; not if the guard itself was killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.engine_pgid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):  # let the pipe close so the transport shuts down cleanly
            await asyncio.wait_for(proc.wait(), 5)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    supervisor = Supervisor(args, make_adapter(args.engine), launch_from_args(args))
    return asyncio.run(supervisor.run())
