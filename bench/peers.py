"""Peer routers (vllm-router, sglang-router, LMDeploy's proxy): install each in its own venv, start, stop.

Owns the install recipe, the version check and each peer's start command; it does not send
load or judge results. Every peer listens on 127.0.0.1 and is stopped by PID (whole group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.procstat import ProcessTree

BENCH_DIR = Path(__file__).resolve().parent
PEERS_DIR = BENCH_DIR / ".peers"

# What `lmdeploy serve proxy` imports, found by trying (bench/README.md): lmdeploy's package
# __init__ pulls its pipeline, whose messages module imports torch at module level, so the
# proxy needs torch (the CPU wheel) and transformers although it never runs a model. With
# --no-deps this is 1.6 GB instead of 7.7 GB (CUDA torch, triton, tilelang, ...).
LMDEPLOY_PROXY_DEPS = [
    "torch==2.13.0+cpu", "transformers", "shortuuid", "mmengine-lite", "psutil", "pillow", "pybase64",
    "openai-harmony", "fastapi", "uvicorn", "requests", "aiohttp", "pydantic", "fire", "numpy", "tqdm",
    "typing_extensions",
]


@dataclass(frozen=True)
class PeerSpec:
    name: str  # also the venv folder under bench/.peers/
    dist: str  # distribution whose version is checked
    version: str
    install: list[list[str]]  # pip argument lists, run in order
    policies: tuple[str, ...]
    # step index -> pip arguments to try when that step fails (e.g. no CPU torch wheel at hand)
    fallbacks: dict[int, list[str]] = field(default_factory=dict)


def peer_specs() -> dict[str, PeerSpec]:
    return {
        "vllm-router": PeerSpec("vllm-router", "vllm-router", "0.1.17", [["vllm-router==0.1.17"]],
                                ("round_robin", "cache_aware", "power_of_two", "kv_aware")),
        "sglang-router": PeerSpec("sglang-router", "sglang-router", "0.3.2", [["sglang-router==0.3.2"]],
                                  ("round_robin", "cache_aware", "power_of_two")),
        "lmdeploy": PeerSpec("lmdeploy", "lmdeploy", "0.18.0",
                             [["--no-deps", "lmdeploy==0.18.0"], LMDEPLOY_PROXY_DEPS],
                             ("min_expected_latency", "random", "min_observed_latency"),
                             # no CPU torch wheel at hand: PyPI's default torch build (larger, still works)
                             fallbacks={1: [("torch" if d.startswith("torch==") else d)
                                            for d in LMDEPLOY_PROXY_DEPS]}),
    }


def _venv_python(spec: PeerSpec) -> Path:
    return PEERS_DIR / spec.name / "bin" / "python"


def installed_version(spec: PeerSpec) -> str | None:
    py = _venv_python(spec)
    if not py.exists():
        return None
    out = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({spec.dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_installed(name: str, log=print) -> Path:
    """Create bench/.peers/NAME and pip-install the peer on first use; check its version. Idempotent."""
    spec = peer_specs()[name]
    venv = PEERS_DIR / spec.name
    if installed_version(spec) == spec.version and (venv / ".ready").exists():
        return venv
    log(f"installing {name} {spec.version} into {venv} (first use; takes a minute or more)")
    if not _venv_python(spec).exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(_venv_python(spec)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for i, step in enumerate(spec.install):
        if subprocess.run(pip + step).returncode == 0:
            continue
        fallback = spec.fallbacks.get(i)
        if fallback is None or subprocess.run(pip + fallback).returncode != 0:
            raise RuntimeError(f"pip install {' '.join(step)} failed for {name}")
    got = installed_version(spec)
    if got != spec.version:
        raise RuntimeError(f"{name}: installed version {got}, expected {spec.version}")
    (venv / ".ready").write_text(spec.version)
    return venv


@dataclass(frozen=True)
class KvEventSources:
    """Where each worker publishes its KV-cache events, for vllm-router's kv_aware policy (bench/fleet.py starts
    the sims with them). The topic is vLLM's default, "": vllm-router's static sources cannot name another."""

    endpoints: dict[str, tuple[str, str]]  # worker URL -> (events, replay) endpoint, as the router connects
    block_size: int
    model: str  # the identity vllm-router files the workers' blocks under (a label: requests are not matched to it)

    def router_args(self) -> list[str]:
        """vllm-router's flags: one --kv-event-source and --kv-event-replay-source per worker."""
        args: list[str] = []
        for url, (events, replay) in self.endpoints.items():
            args += ["--kv-event-source", f"{url}={events}", "--kv-event-replay-source", f"{url}={replay}"]
        return [*args, "--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model]


@dataclass
class RunningRouter:
    """A router process the bench started; `tree` reads its CPU time and RSS (children included)."""

    name: str  # e.g. "vllm-router:cache_aware"
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    tree: ProcessTree

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, timeout: float = 10.0) -> None:
        stop_process_group(self.popen, timeout)


def stop_process_group(popen: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM the group the bench started, wait, then SIGKILL whatever is left (by PGID = our PID)."""
    import signal

    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        popen.wait(5)
    except subprocess.TimeoutExpired:
        pass


def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=str(BENCH_DIR.parent))


def _get(url: str, timeout: float = 1.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""


def _post_json(url: str, body: dict, timeout: float = 5.0) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_ready(url: str, popen: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0,
               path: str = "/v1/models", want_models: int = 1, headers: dict[str, str] | None = None) -> None:
    """Wait until GET url+path answers 200 (and lists a model) or the process dies. `headers`: what a client
    sends (a router that forwards /v1/models to engines that want a key needs the key)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{log_path.stem} exited ({popen.returncode}):\n{log_path.read_text()[-2000:]}")
        status, body = _get(url + path, headers=headers)
        if status == 200:
            if path != "/v1/models":
                return
            try:
                if len(json.loads(body).get("data") or []) >= want_models:
                    return
            except ValueError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"{log_path.stem} not ready at {url}{path} after {timeout}s:\n{log_path.read_text()[-2000:]}")


def check_kv_events(name: str, policy: str, kv_events: KvEventSources | None) -> None:
    """KV-event sources go with vllm-router:kv_aware, and only there (no other peer here reads them)."""
    if (name == "vllm-router" and policy == "kv_aware") != (kv_events is not None):
        raise ValueError(f"{name}:{policy}: KV-event sources go with vllm-router:kv_aware only "
                         f"({'given' if kv_events else 'none given'})")


def router_command(venv: Path, name: str, policy: str, worker_urls: list[str], port: int, metrics_port: int,
                   kv_events: KvEventSources | None = None) -> list[str]:
    """vllm-router's or sglang-router's command line; vllm-router's kv_aware also gets the workers' event sources."""
    check_kv_events(name, policy, kv_events)
    exe = [str(venv / "bin" / "vllm-router")] if name == "vllm-router" else \
        [str(venv / "bin" / "sglang-router"), "launch"]
    return exe + ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
                  "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                  "--log-level", "warning" if name == "vllm-router" else "warn",
                  *(kv_events.router_args() if kv_events else ())]


def start_peer(name: str, policy: str, worker_urls: list[str], port: int, metrics_port: int,
               log_dir: Path, kv_events: KvEventSources | None = None,
               headers: dict[str, str] | None = None) -> RunningRouter:
    """Start one peer router with `policy` over `worker_urls` on 127.0.0.1:port; wait until it routes (a router
    that does not come up is stopped before the error goes on). `kv_events`: where the workers publish their
    KV-cache events (vllm-router:kv_aware needs them); `headers`: what clients send (the engines' API key)."""
    check_kv_events(name, policy, kv_events)
    venv = ensure_installed(name)
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{name}-{policy}-{port}.log"
    if name in ("vllm-router", "sglang-router"):
        args = router_command(venv, name, policy, worker_urls, port, metrics_port, kv_events)
        popen = spawn(args, log_path)
        try:
            wait_ready(url, popen, log_path, path="/v1/models", headers=headers)
        except BaseException:
            RunningRouter(name, url, popen, log_path, ProcessTree(popen.pid)).stop()
            raise
    elif name == "lmdeploy":
        # A node list persisted by an earlier run would be loaded at import time: start clean.
        site = next((venv / "lib").glob("python*/site-packages/lmdeploy/serve/proxy"))
        (site / "proxy_config.json").unlink(missing_ok=True)
        args = [str(venv / "bin" / "lmdeploy"), "serve", "proxy", "--server-name", "127.0.0.1",
                "--server-port", str(port), "--routing-strategy", policy, "--disable-cache-status",
                "--log-level", "WARNING"]
        popen = spawn(args, log_path, env={"UVICORN_LOG_LEVEL": "warning"})
        try:
            wait_ready(url, popen, log_path, path="/nodes/status")
            for w in worker_urls:
                models = json.loads(_get(w + "/v1/models")[1])["data"]
                status = _post_json(url + "/nodes/add", {"url": w, "status": {"models": [m["id"] for m in models]}})
                if status != 200:
                    raise RuntimeError(f"lmdeploy /nodes/add {w} answered {status}")
            wait_ready(url, popen, log_path, path="/v1/models")
        except BaseException:
            RunningRouter(name, url, popen, log_path, ProcessTree(popen.pid)).stop()
            raise
    else:
        raise ValueError(f"unknown peer {name}")
    return RunningRouter(f"{name}:{policy}", url, popen, log_path, ProcessTree(popen.pid))


def main() -> int:
    """`python -m bench.peers`: install every peer and print the versions."""
    for name in peer_specs():
        ensure_installed(name)
        print(name, installed_version(peer_specs()[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
