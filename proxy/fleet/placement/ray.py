"""placement: ray — each replica a Ray actor that holds its GPUs and runs `kvroute worker` on its node.

Owns connecting to an existing cluster (state.ray_address), creating one actor per worker with
num_gpus = gpus_per_replica (or a custom resource standing in for GPUs), and the handle that
stops it. Ray is imported only when a model asks for this placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.fleet.launcher import WorkerLaunch

log = logging.getLogger("kvroute.fleet")


class WorkerActor:
    """Lives on a Ray node; starts the worker as a subprocess there and reports on it.

    An async actor, so `wait()` can block for the worker's whole life while `terminate()`
    and `kill()` still get through.
    """

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, launch: WorkerLaunch, run_dir: str) -> dict[str, Any]:
        import ray

        from proxy.fleet.placement.local import _die_with_parent

        node_ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((node_ip, 0))
            port = s.getsockname()[1]
        url = f"http://{node_ip}:{port}"
        gpus = [str(g) for g in ray.get_gpu_ids()]  # Ray set CUDA_VISIBLE_DEVICES to these for this actor
        launch.gpus = gpus or None
        log_path = Path(run_dir) / f"{launch.worker_id}.log"
        await asyncio.to_thread(log_path.parent.mkdir, parents=True, exist_ok=True)
        log_file = await asyncio.to_thread(open, log_path, "ab")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *launch.argv(node_ip, port, advertise_url=url, python=sys.executable),
                stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **launch.env()}, start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log_file.close()
        return {"pid": self.proc.pid, "url": url, "node": node_ip, "gpus": gpus, "log": str(log_path)}

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def terminate(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    async def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.returncode is None:
            await self.proc.wait()


class RayWorker:
    """The driver's handle on one actor-hosted worker."""

    def __init__(self, actor: Any, info: dict[str, Any]) -> None:
        self.actor = actor
        self.pid: int | None = info["pid"]
        self.url: str = info["url"]
        self.node: str = info["node"]
        self.gpus: list[str] = info["gpus"]

    async def wait(self) -> int:
        try:
            return await self.actor.wait.remote()
        except Exception as exc:  # the actor or its node died: for supervision that is a crash
            log.warning("ray actor for %s lost: %s", self.url, exc)
            return -1

    async def terminate(self) -> None:
        with contextlib.suppress(Exception):
            await self.actor.terminate.remote()

    async def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.actor.kill.remote(), 15)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.kill, self.actor)  # frees the GPUs it held


def _is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RayPlacement:
    name = "ray"

    def __init__(self, address: str, proxy_url: str | None, proxy_port: int = 0, gpu_resource: str = "GPU",
                 run_dir: str | None = None) -> None:
        self.address = address
        # The proxy as the nodes reach it; None: this node's Ray address plus the proxy's port.
        self.proxy_url = proxy_url
        self.proxy_port = proxy_port
        self.gpu_resource = gpu_resource
        self.run_dir = run_dir or str(Path(tempfile.gettempdir()) / "kvroute-ray")
        self._connected = False
        self._lock = asyncio.Lock()

    async def _connect(self) -> None:
        async with self._lock:
            if self._connected:
                return
            import ray

            await asyncio.to_thread(ray.init, address=self.address, namespace="kvroute", log_to_driver=False,
                                    ignore_reinit_error=True, configure_logging=False)
            self._connected = True
            if self.proxy_url is None:
                self.proxy_url = f"http://{ray.util.get_node_ip_address()}:{self.proxy_port}"
            log.info("connected to Ray cluster at %s", self.address)

    def actor_options(self, launch: WorkerLaunch) -> dict[str, Any]:
        n = launch.model.gpus_per_replica
        opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 8}
        if n:
            if self.gpu_resource == "GPU":
                opts["num_gpus"] = n
            else:
                opts["resources"] = {self.gpu_resource: n}
        return opts

    async def start(self, launch: WorkerLaunch) -> RayWorker:
        await self._connect()
        import ray

        assert self.proxy_url is not None
        launch.proxy_url = self.proxy_url
        actor_cls = ray.remote(WorkerActor)
        actor = actor_cls.options(**self.actor_options(launch)).remote()
        try:
            # Actor creation waits for resources; a fleet larger than the cluster waits here, not forever.
            info = await asyncio.wait_for(actor.start.remote(launch, self.run_dir), launch.model.startup_timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray.kill, actor)
            raise
        held = self.actor_options(launch).get("resources", {})
        if not info["gpus"] and held:  # a custom resource has no device ids: show what is held
            info["gpus"] = [f"{n:g} {name}" for name, n in held.items()]
        log.info("%s: actor on node %s holds %s", launch.worker_id, info["node"], info["gpus"] or "no GPUs")
        if _is_loopback_url(self.proxy_url) and not _is_loopback_url(info["url"]):
            # The worker registers with a proxy on *its* loopback, i.e. nowhere: say so instead of timing out.
            log.error("%s runs on node %s but dials the proxy at %s, which only this machine reaches; start "
                      "kvroute up with --host 0.0.0.0 or --advertise-url http://THIS_NODE:PORT",
                      launch.worker_id, info["node"], self.proxy_url)
        return RayWorker(actor, info)

    def release(self, worker_id: str) -> None:
        return None

    async def close(self) -> None:
        if self._connected:
            import ray

            await asyncio.to_thread(ray.shutdown)
            self._connected = False
