"""A benchmark fleet: N sim workers plus, on demand, a kvroute proxy or a peer router in front of them.

Owns starting, readiness and stopping (by PID, whole process group) of bench processes, and
scraping the workers' /metrics; it does not generate load or format results.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.peers import KvEventSources, RunningRouter, _get, spawn, start_peer, stop_process_group, wait_ready
from bench.procstat import ProcessTree
from proxy import promtext

KVROUTE = [sys.executable, "-m", "proxy.cli"]


# routes (kind, policy) whose router reads the engines' KV-cache events: their sims publish them
KV_EVENT_ROUTES = {("vllm-router", "kv_aware")}


def reads_kv_events(kind: str, policy: str) -> bool:
    return (kind, policy) in KV_EVENT_ROUTES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SimWorkerSpec:
    model: str = "m"
    preset: str = "h100-qwen3-vl-8b"
    time_scale: float = 1.0
    extra: list[str] = field(default_factory=list)  # more `kvroute worker` flags


@dataclass
class Fleet:
    """Sim workers that report to `proxy_url` (whether or not a kvroute proxy is up at the time)."""

    log_dir: Path
    workers: list[SimWorkerSpec]
    proxy_port: int = field(default_factory=free_port)
    kv_events: bool = False  # each sim also publishes its KV-cache events (vLLM's --kv-events-config)
    urls: list[str] = field(default_factory=list)
    event_endpoints: list[tuple[str, str]] = field(default_factory=list)  # per sim: (events, replay), to connect to
    _procs: list = field(default_factory=list)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def start(self, timeout: float = 60.0) -> None:
        for i, w in enumerate(self.workers):
            port = free_port()
            args = [*KVROUTE, "worker", "--engine", "sim", "--port", str(port), "--served-model-name", w.model,
                    "--preset", w.preset, "--time-scale", str(w.time_scale), "--seed", str(i),
                    "--proxy-url", self.proxy_url, "--worker-id", f"sim-{i}", "--log-level", "warning", *w.extra]
            if self.kv_events:
                args += ["--kv-events-config", self.publisher_config()]
            self._procs.append(spawn(args, self.log_dir / f"sim-{i}.log"))
            self.urls.append(f"http://127.0.0.1:{port}")
        for i, (url, proc) in enumerate(zip(self.urls, self._procs, strict=True)):
            wait_ready(url, proc, self.log_dir / f"sim-{i}.log", timeout=timeout)

    def publisher_config(self) -> str:
        """One sim's --kv-events-config on two free ports, bound on every interface (vLLM binds a wildcard host;
        a bound SUB does not hear a connecting PUB with this machine's libzmq); vLLM's default topic, ""."""
        events, replay = free_port(), free_port()
        self.event_endpoints.append((f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                           "replay_endpoint": f"tcp://*:{replay}", "topic": ""})

    def kv_event_sources(self) -> KvEventSources:
        """Where the sims publish their KV-cache events, for a router that reads them (needs kv_events=True)."""
        from backends.sim.presets import get_preset

        if not self.kv_events:
            raise ValueError("this fleet's sims publish no KV-cache events (Fleet(kv_events=True))")
        sizes = {get_preset(w.preset).block_size for w in self.workers}
        if len(sizes) != 1:
            raise ValueError(f"one KV block size for the fleet's event sources, not {sorted(sizes)}")
        return KvEventSources(dict(zip(self.urls, self.event_endpoints, strict=True)), sizes.pop(),
                              "+".join(sorted({w.model for w in self.workers})))

    def stop(self) -> None:
        for proc in self._procs:
            stop_process_group(proc)
        self._procs.clear()

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def sim_states(self) -> list[dict]:
        """Each sim worker's GET /sim/state (the engine's own counters: no /metrics parsing)."""
        import json

        out = []
        for u in self.urls:
            status, body = _get(u + "/sim/state", 5.0)
            out.append(json.loads(body) if status == 200 else {})
        return out

    def metrics(self) -> list[dict[str, float]]:
        """Each worker's /metrics, summed over label sets per metric name."""
        return [scrape_metrics(u) for u in self.urls]

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scrape_metrics(base_url: str, timeout: float = 2.0) -> dict[str, float]:
    """Sample name -> sum over its label sets (proxy/promtext.py parses); {} if /metrics fails."""
    status, body = _get(base_url + "/metrics", timeout)
    if status != 200:
        return {}
    return promtext.parse(body.decode(errors="replace")).totals()


def _listed_workers(proxy_url: str) -> list[dict] | None:
    """The proxy's GET /workers list, or None when it does not answer."""
    status, body = _get(proxy_url + "/workers", 2.0)
    if status != 200:
        return None
    data = json.loads(body)
    items = data.get("workers", data) if isinstance(data, dict) else data
    return [w for w in items if isinstance(w, dict)]


def _registered_workers(proxy_url: str) -> int:
    items = _listed_workers(proxy_url)
    return -1 if items is None else sum(1 for w in items if str(w.get("state", "ready")) == "ready")


def _registration_report(fleet: Fleet, router_log: Path) -> str:
    """Why the fleet did not register: the proxy's view of each worker, its own log, and each sim's log tail."""
    items = _listed_workers(fleet.proxy_url)
    seen = "no answer from /workers" if items is None else "\n".join(
        f"  {w.get('worker_id')} {w.get('url')} state={w.get('state')} error={w.get('last_error')}" for w in items)
    sims = "".join(f"\n--- {path.name} ---\n{path.read_text(errors='replace')[-1500:]}"
                   for path in sorted(fleet.log_dir.glob("sim-*.log")) if path.is_file())
    return f"the proxy lists:\n{seen or '  nothing'}\n--- {router_log.name} ---\n{router_log.read_text()[-2000:]}{sims}"


def kvroute_command(policy_spec: str, port: int, log_dir: Path) -> tuple[str, list[str]]:
    """(policy, argv) for `kvroute proxy`. A spec "kv_aware@prefix_weight=0+hw=1.0" runs a variant: its knobs
    go into the config file the proxy starts with (bench/route_spec.py), process settings through bench/ablate.py.
    The knob `tree=PATH` runs the proxy (and bench/ablate.py) from another source tree, a checkout or
    `git worktree` of this repository: two trees side by side on one fleet in one run (its proxy must know the
    config keys the spec sets)."""
    from bench.route_spec import parse_route_spec

    route = parse_route_spec(policy_spec)
    args = ["proxy", "--host", "127.0.0.1", "--port", str(port), "--policy", route.policy, "--log-level",
            os.environ.get("KVROUTE_BENCH_PROXY_LOG_LEVEL", "warning")]  # debug: every routing decision in its log
    if route.proxy:
        cfg = route.write_config(log_dir / f"proxy-{abs(hash(policy_spec))}.yaml")
        args += ["--config", str(cfg)]
    module, argv = ("bench.ablate", [*route.process, "--", *args]) if route.process else ("proxy.cli", args)
    if route.tree is not None:
        # the tree's modules ahead of this one's (sys.path[0] is the working directory, this repository)
        code = (f"import runpy, sys; sys.path.insert(0, {route.tree!r}); "
                f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
        return route.policy, [sys.executable, "-c", code, *argv]
    if route.process:
        return route.policy, [sys.executable, "-m", module, *argv]
    return route.policy, [*KVROUTE, *argv]


def start_kvroute(fleet: Fleet, policy: str, timeout: float = 60.0) -> RunningRouter:
    """Start `kvroute proxy` on the fleet's proxy port and wait until every worker has registered."""
    url = fleet.proxy_url
    safe = policy.replace("@", "-").replace("+", "-").replace("=", "").replace("/", "_")
    log_path = fleet.log_dir / f"kvroute-{safe}-{fleet.proxy_port}.log"
    _, args = kvroute_command(policy, fleet.proxy_port, fleet.log_dir)
    popen = spawn(args, log_path)
    router = RunningRouter(f"kvroute:{policy}", url, popen, log_path, ProcessTree(popen.pid))
    try:
        wait_ready(url, popen, log_path, timeout=timeout, path="/health")
        deadline = time.monotonic() + timeout
        while _registered_workers(url) < len(fleet.urls):
            if time.monotonic() > deadline or popen.poll() is not None:
                raise TimeoutError(f"only {_registered_workers(url)} of {len(fleet.urls)} workers registered "
                                   f"with kvroute; {_registration_report(fleet, log_path)}")
            time.sleep(0.1)
    except BaseException:
        router.stop()
        raise
    return router


def resolve_default(policy_spec: str) -> str:
    """A kvroute route's policy spec with "default" (or nothing) before its knobs made default_policy()."""
    name, at, knobs = policy_spec.partition("@")
    return default_policy() + at + knobs if name in ("", "default") else policy_spec


def default_policy() -> str:
    """kvroute's out-of-the-box policy, as its config says (whatever the routing helpers made default)."""
    from proxy.config import ProxyConfig

    return str(ProxyConfig().policy)


BARE_RELAY = "bare-relay"  # bench/bare_relay.py: round robin and nothing else, the floor of a Python relay


def start_oracle(fleet: Fleet, policy: str = "", timeout: float = 60.0) -> RunningRouter:
    """bench/oracle.py over the fleet's sim workers (bench only: reads each engine's true state); `policy`:
    its scoring ('' or 'ttft': predicted TTFT; 'kv_aware', 'kv_aware_owner': kvroute's default cost on the
    true state, see the module docstring), then '@' and '+'-separated options, each a flag of bench/oracle.py
    without its dashes ('kv_aware@send_now', 'kv_aware@stale_s=0.25+sent_prefix')."""
    scoring, _, options = policy.partition("@")
    extra = ["--policy", scoring] if scoring else []
    for option in filter(None, options.split("+")):
        name, eq, value = option.partition("=")
        extra += [f"--{name.replace('_', '-')}", *((value,) if eq else ())]
    return start_bench_router(fleet, "bench.oracle", "oracle", timeout=timeout, extra=extra)


def start_bench_router(fleet: Fleet, module: str, name: str, path: str = "/v1/models",
                       timeout: float = 60.0, extra: Sequence[str] = ()) -> RunningRouter:
    """A router the bench itself provides (`python -m MODULE --port P [EXTRA] URL...`), started and waited for."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = fleet.log_dir / f"{name}-{port}.log"
    popen = spawn([sys.executable, "-m", module, "--port", str(port), *extra, *fleet.urls], log_path)
    router = RunningRouter(name, url, popen, log_path, ProcessTree(popen.pid))
    try:
        wait_ready(url, popen, log_path, timeout=timeout, path=path)
    except BaseException:
        router.stop()
        raise
    return router


def start_router(kind: str, policy: str, fleet: Fleet) -> RunningRouter:
    """kind 'kvroute' (policy 'default' = ProxyConfig's), 'oracle', 'bare-relay' or a peer name; peers get
    the worker URLs."""
    if kind == "kvroute":
        return start_kvroute(fleet, resolve_default(policy))
    if kind == "oracle":
        return start_oracle(fleet, policy)
    if kind == BARE_RELAY:
        return start_bench_router(fleet, "bench.bare_relay", BARE_RELAY, path="/health")
    return start_peer(kind, policy, fleet.urls, free_port(), free_port(), fleet.log_dir,
                      fleet.kv_event_sources() if reads_kv_events(kind, policy) else None)


