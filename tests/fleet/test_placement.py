"""What a Ray actor asks the cluster for: its GPUs as num_gpus, or a custom resource standing in for them."""

from __future__ import annotations

from proxy.config import ModelConfig
from proxy.fleet.launcher import WorkerLaunch
from proxy.fleet.placement.ray import RayPlacement


def launch(gpus: int) -> WorkerLaunch:
    m = ModelConfig(name="q", engine="vllm", model="/m", placement="ray", gpus_per_replica=gpus)
    return WorkerLaunch(worker_id="q-0", model=m, proxy_url="http://p")


def test_actor_holds_num_gpus_for_tensor_parallel_replicas():
    opts = RayPlacement("auto", None).actor_options(launch(4))
    assert opts["num_gpus"] == 4 and "resources" not in opts
    assert opts["num_cpus"] == 0 and opts["max_restarts"] == 0  # kvroute, not Ray, restarts workers


def test_custom_resource_stands_in_for_gpus():
    opts = RayPlacement("auto", None, gpu_resource="fake_gpu").actor_options(launch(2))
    assert opts["resources"] == {"fake_gpu": 2} and "num_gpus" not in opts


def test_cpu_replica_holds_nothing():
    sim = WorkerLaunch(worker_id="c-0", model=ModelConfig(name="c", engine="sim", placement="ray"), proxy_url="http://p")
    opts = RayPlacement("auto", None).actor_options(sim)
    assert "num_gpus" not in opts and "resources" not in opts
