"""The fleet manager: keeps the running replicas equal to the desired config (the file, `apply`, `scale`).

Owns the diff between desired and running (start missing, drain extra, rolling restart on a spec
change), GPU bookkeeping across replicas, and watching the proxy's registry for readiness. It
does not know how a process is started (placement/) or how one replica is supervised (supervisor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.config import FleetConfig, ModelConfig
from proxy.fleet.gpus import GpuDemand, GpuPool, plan_assignment
from proxy.fleet.launcher import PoolSpec, WorkerLaunch, pools_of, spec_fingerprint, worker_id_for
from proxy.fleet.placement.base import Placement
from proxy.fleet.proxyclient import ProxyControl, record_state
from proxy.fleet.supervisor import FAILED, READY, Replica, RestartPolicy
from proxy.routing.live_changes import merge

log = logging.getLogger("kvroute.fleet")

REGISTRY_POLL_S = 0.5


def local_gpu_demands(config: FleetConfig) -> list[GpuDemand]:
    """GPUs this machine must provide: local replicas that run on CUDA (Ray models get theirs from Ray)."""
    return [GpuDemand(p.label, p.replicas, p.model.gpus_per_replica) for m in config.models for p in pools_of(m)
            if m.placement == "local" and m.device == "cuda" and p.model.gpus_per_replica > 0]


def _pool_plan(old: ModelConfig | None, new: ModelConfig) -> str:
    """What apply() will do to one model, pool by pool when it has pools."""
    if old is None:
        return "add " + ", ".join(f"{p.replicas} {p.role} replica(s)" if p.pooled else f"{p.replicas} replica(s)"
                                  for p in pools_of(new))
    before = {p.role: p for p in pools_of(old)}
    steps = []
    for p in pools_of(new):
        was = before.pop(p.role, None)
        prefix = f"{p.role}: " if p.pooled else ""
        if was is None:
            steps.append(f"{prefix}add {p.replicas} replica(s)")
        elif spec_fingerprint(was.model, was.role) != spec_fingerprint(p.model, p.role):
            steps.append(f"{prefix}rolling restart to the new spec, {was.replicas} -> {p.replicas} replica(s)")
        elif was.replicas != p.replicas:
            steps.append(f"{prefix}scale {was.replicas} -> {p.replicas}")
        else:
            steps.append(f"{prefix}unchanged")
    steps += [f"{role}: remove (drain all replicas)" for role in before]
    return "; ".join(steps)


class FleetManager:
    def __init__(self, config: FleetConfig, *, proxy_url: str, control: ProxyControl,
                 placements: dict[str, Placement] | Callable[[str], Placement], gpus: GpuPool,
                 restart_policy: RestartPolicy | None = None, log_level: str = "info") -> None:
        self.desired = config
        self.config_path: Path | None = None  # `kvroute up`'s file: /fleet/scale writes the new count there
        self.config_rewritten: Callable[[], None] | None = None  # told when /fleet/scale has rewritten it
        # The running proxy's tokens are those it started with (an applied config's proxy section needs a
        # restart); without a worker token the proxy accepts only the admin token from workers too.
        self.worker_token = config.proxy.worker_token or config.proxy.admin_token
        self.proxy_url = proxy_url
        self.control = control
        self._placements = placements
        self.gpus = gpus
        self.restart_policy = restart_policy or RestartPolicy()
        self.log_level = log_level
        self.replicas: dict[str, Replica] = {}  # every worker we own, draining ones included
        self.last_error: str | None = None
        self.applied_at: float | None = None
        self.generation = 0  # bumped on every accepted desired state
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._reconciled_generation = -1
        self._closing = False
        self._retry: set[str] = set()
        self._tick = asyncio.Event()  # set after every registry poll
        # Called with each accepted desired state (the in-process proxy learns new models and aliases).
        self.on_apply: list[Callable[[FleetConfig], None]] = []

    # --- desired state ---------------------------------------------------------------------

    def check(self, config: FleetConfig) -> None:
        """Raise GpuAssignmentError if `config` cannot run here (checked before it is accepted)."""
        plan_assignment(local_gpu_demands(config), self.gpus.gpus, self.gpus.source)

    def apply(self, config: FleetConfig) -> dict[str, Any]:
        """Accept a new desired state and reconcile towards it in the background; returns the plan.

        Raises GpuAssignmentError (does not fit) or ConfigError (unknown policy) and keeps the old state."""
        self.check(config)
        change = merge(self.desired, config)  # refuses an unknown policy before anything changes
        before = {m.name: m for m in self.desired.models}
        plan: dict[str, Any] = {}
        for m in config.models:
            plan[m.name] = _pool_plan(before.pop(m.name, None), m)
        for name in before:
            plan[name] = "remove (drain all replicas)"
        # Live proxy keys (policy, timeouts, queue, retries, ...) change now, the others are reported as
        # needing a restart (liveconfig.py); the proxy in this process takes the result (on_apply).
        if change.describe():
            plan["proxy"] = change.describe()
        if change.restart:  # a warning reaches the terminal of `kvroute up`, not only its log file
            log.warning("the new config changes %s: NOT applied, restart kvroute up to use them",
                        ", ".join(change.restart))
        config = change.config
        self.desired = config
        self.generation += 1
        for listener in self.on_apply:
            listener(config)
        # An explicit apply retries replicas that gave up after a crash loop.
        self._retry |= {r.worker_id for r in self.replicas.values() if r.state == FAILED}
        self.applied_at = time.time()
        self._wake.set()
        log.info("new desired state: %s", plan)
        return plan

    def scale(self, model: str, replicas: int, role: str | None = None) -> dict[str, Any]:
        """Set one model's replicas, or one pool's (`role`); KeyError: no such model, ValueError: no such pool
        (a model with pools needs its role, one without has only role both)."""
        m = self.desired.model(model)
        if m is None:
            raise KeyError(model)
        if m.pools:
            if role is None:
                raise ValueError(f"{m.name} has pools ({', '.join(p.role for p in m.pools)}): say which one to scale")
            if role not in {p.role for p in m.pools}:
                raise ValueError(f"{m.name} has no {role} pool ({', '.join(p.role for p in m.pools)})")
            pools = [p.model_copy(update={"replicas": replicas}) if p.role == role else p for p in m.pools]
            scaled = m.model_copy(update={"pools": pools})
        elif role not in (None, "both"):
            raise ValueError(f"{m.name} has no pools: it has only role both")
        else:
            scaled = m.model_copy(update={"replicas": replicas})
        models = [scaled if mm is m else mm for mm in self.desired.models]
        return self.apply(self.desired.model_copy(update={"models": models}))

    # --- running ---------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._reconcile_loop(), name="fleet-reconcile"),
                       asyncio.create_task(self._watch_registry(), name="fleet-registry")]
        self._wake.set()

    def placement(self, name: str) -> Placement:
        if callable(self._placements):
            return self._placements(name)
        return self._placements[name]

    def _current(self, model: str, role: str) -> list[Replica]:
        return [r for r in self.replicas.values()
                if r.model_name == model and r.role == role and r.state not in ("draining", "stopped")]

    def _desired_pools(self) -> dict[tuple[str, str], PoolSpec]:
        return {(p.name, p.role): p for m in self.desired.models for p in pools_of(m)}

    def all_ready(self) -> bool:
        pools = self._desired_pools()
        want = sum(p.replicas for p in pools.values())
        ready = [r for r in self.replicas.values() if r.ready]
        fresh = all(r.fingerprint == spec_fingerprint(p.model, p.role)
                    for r in ready if (p := pools.get((r.model_name, r.role))))
        return self._reconciled_generation == self.generation and len(ready) == want and fresh

    def any_failed(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state == FAILED]

    async def _reconcile_loop(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            generation = self.generation
            try:
                await self._reconcile_once(self.desired)
                self._reconciled_generation = generation
            except Exception as exc:  # keep the fleet manager alive; the next trigger retries
                log.exception("reconcile failed")
                self.last_error = f"reconcile failed: {exc}"

    async def _reconcile_once(self, config: FleetConfig) -> None:
        wanted = {(p.name, p.role) for m in config.models for p in pools_of(m)}
        stops = [r for r in self.replicas.values()
                 if (r.model_name, r.role) not in wanted and r.state not in ("draining", "stopped")]
        rolling: list[tuple[PoolSpec, Replica]] = []
        for pool in (p for m in config.models for p in pools_of(m)):
            fp = spec_fingerprint(pool.model, pool.role)
            current = self._current(pool.name, pool.role)
            by_index = {r.index: r for r in current}
            # Extra replicas go first, failed or unready ones before serving ones.
            extra = sorted((r for r in current if r.index >= pool.replicas), key=lambda r: (r.ready, r.index))
            stops += extra
            for i in range(pool.replicas):
                r = by_index.get(i)
                if r is None:
                    self._spawn(pool, i)
                elif r.worker_id in self._retry and r.fingerprint == fp:
                    self._retry.discard(r.worker_id)
                    await self._stop(r)
                    self._spawn(pool, i)
                elif r.fingerprint != fp:
                    rolling.append((pool, r))
        if stops:
            await asyncio.gather(*(self._stop(r) for r in stops))
        for m, old in rolling:
            if self.desired is not config:
                return  # a newer desired state arrived: start over from it (the loop is woken)
            await self._replace(m, old)

    def _spawn(self, pool: PoolSpec, index: int) -> Replica:
        m = pool.model
        generation = 0
        while worker_id_for(m.name, index, generation, pool.role) in self.replicas:
            generation += 1
        wid = worker_id_for(m.name, index, generation, pool.role)
        gpus: list[str] | None = None
        if m.placement == "local":
            count = m.gpus_per_replica if m.device == "cuda" else 0
            gpus = self.gpus.allocate(count, wid)  # GpuAssignmentError propagates: nothing started
        placement = self.placement(m.placement)
        launch = WorkerLaunch(worker_id=wid, model=m, proxy_url=self.proxy_url, gpus=gpus,
                              drain_grace_s=self.desired.proxy.drain_grace_s,
                              worker_token=self.worker_token,
                              log_level=self.log_level, role=pool.role)
        r = Replica(launch, index, generation, spec_fingerprint(m, pool.role), placement, self.restart_policy,
                    on_crash=lambda dead: self.control.deregister(dead.worker_id))
        self.replicas[wid] = r
        r.start()
        log.info("starting %s (gpus %s)", wid, gpus if gpus is not None else "from placement")
        return r

    async def _stop(self, r: Replica) -> None:
        grace = self.desired.proxy.drain_grace_s
        await r.stop(grace, drain=lambda: self.control.drain(r.worker_id))
        await self.control.deregister(r.worker_id)  # a crashed worker could not do it itself
        self.gpus.release(r.worker_id)
        self.replicas.pop(r.worker_id, None)
        log.info("stopped %s", r.worker_id)

    async def _replace(self, pool: PoolSpec, old: Replica) -> None:
        """Rolling restart of one replica: the new one serves before the old one drains (capacity kept),
        unless the GPUs for both do not exist, then the old one goes first."""
        m = pool.model
        need = m.gpus_per_replica if m.placement == "local" and m.device == "cuda" else 0
        if need and not self.gpus.can_allocate([need]):
            log.warning("%s: no spare GPUs to start its replacement first; restarting in place", old.worker_id)
            await self._stop(old)
            new = self._spawn(pool, old.index)
            # One replica down at a time: the next one waits until this one serves again.
            await self.until(lambda: new.ready or new.state == FAILED or self._closing, m.startup_timeout_s)
            return
        new = self._spawn(pool, old.index)
        await self.until(lambda: new.ready or new.state == FAILED or self._closing, m.startup_timeout_s)
        if new.ready:
            await self._stop(old)
            return
        self.last_error = f"{new.worker_id} did not become ready ({new.last_error or 'timeout'}); kept {old.worker_id}"
        log.error(self.last_error)
        await self._stop(new)

    async def _watch_registry(self) -> None:
        while not self._closing:
            try:
                workers = await self.control.workers()
            except Exception as exc:  # the proxy may be starting or restarting: keep the last view
                log.debug("registry poll failed: %s", exc)
            else:
                for r in list(self.replicas.values()):
                    rec = workers.get(r.worker_id)
                    r.observe_registry(record_state(rec) if rec else None, rec.get("url") if rec else None)
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()
            await asyncio.sleep(REGISTRY_POLL_S)

    async def until(self, predicate: Callable[[], bool], within_s: float) -> bool:
        """Wait (re-checking after every registry poll) until `predicate()` holds; its final value."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while not predicate():
                    await self._tick.wait()
        return predicate()

    async def wait_ready(self, within_s: float) -> bool:
        return await self.until(self.all_ready, within_s)

    async def shutdown(self, drain: bool = True) -> None:
        """Drain and stop every worker (drain=False: kill at once), then stop the background tasks."""
        self._closing = True
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        replicas = list(self.replicas.values())
        if drain:
            await asyncio.gather(*(self._stop(r) for r in replicas), return_exceptions=True)
        else:
            await asyncio.gather(*(r.kill() for r in replicas), return_exceptions=True)
        self.replicas.clear()

    async def kill_all(self) -> None:
        await asyncio.gather(*(r.kill() for r in list(self.replicas.values())), return_exceptions=True)

    # --- views -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        models = []
        for m in self.desired.models:
            rs = [r for r in self.replicas.values() if r.model_name == m.name]
            pools = [{"role": p.role, "desired_replicas": p.replicas, "gpus_per_replica": p.model.gpus_per_replica,
                      "ready": sum(r.state == READY for r in rs if r.role == p.role),
                      "failed": sum(r.state == FAILED for r in rs if r.role == p.role),
                      "fingerprint": spec_fingerprint(p.model, p.role)} for p in pools_of(m)]
            models.append({"name": m.name, "aliases": m.aliases, "engine": m.engine, "placement": m.placement,
                           "desired_replicas": sum(p["desired_replicas"] for p in pools),
                           "gpus_per_replica": m.gpus_per_replica,
                           "ready": sum(r.state == READY for r in rs), "failed": sum(r.state == FAILED for r in rs),
                           "fingerprint": spec_fingerprint(m),
                           "pools": pools if m.pools else []})
        return {"models": models, "replicas": [r.snapshot() for r in self.replicas.values()],
                "gpus": {"visible": self.gpus.gpus, "free": self.gpus.free(), "source": self.gpus.source},
                "converged": self.all_ready(), "last_error": self.last_error, "applied_at": self.applied_at}

