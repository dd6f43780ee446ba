"""Disaggregated pools in config.yaml: a model's replicas by role, the connectors that move KV and encoder
output between them, and the named links those travel over.

Owns the pydantic models of `models[].pools`, `models[].kv_transfer` and `models[].ec_transfer`, the rules
that combine them (`check_pools`), the kv_role each connector wants per role, and the link presets that the
sim (backends/sim/transfer.py) and the decision model (proxy/routing/disagg.py) share. It starts nothing
(proxy/fleet/ launches each pool) and decides nothing per request. Why and how: docs/design/disaggregation.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from proxy.protocol import WorkerRole

ROLES: tuple[str, ...] = get_args(WorkerRole)
LinkName = Literal["nvlink", "rdma-400g", "tcp-25g"]


@dataclass(frozen=True)
class Link:
    """A network between two pools: effective bytes per second one transfer gets, and its fixed cost."""

    name: str
    bytes_per_s: float
    latency_s: float  # per transfer: the request for the blocks, the completion notice (not the handshake)


def link(name: str) -> Link:
    """The link preset `name` (KeyError names the known ones)."""
    # Line rate x an efficiency, one direction (docs/design/disaggregation.md): NVLink 4 (H100/H200 SXM) 450 GB/s
    # each way at 0.8; 400 Gb/s InfiniBand NDR / RoCE 50 GB/s at 0.9; 25 Gb/s Ethernet with TCP 3.125 GB/s at 0.8.
    links = {"nvlink": Link("nvlink", 360e9, 0.0002), "rdma-400g": Link("rdma-400g", 45e9, 0.0005),
             "tcp-25g": Link("tcp-25g", 2.5e9, 0.001)}
    if name not in links:
        raise KeyError(f"unknown link {name!r}; known: {', '.join(links)}")
    return links[name]


# The kv_role vLLM wants per pool role: the prefill pool produces KV, the decode pool consumes it, a both pool
# does either. vLLM 0.32 deprecates kv_both on NIXL's prefill and decode instances, so no connector is special.
_KV_ROLE_DEFAULT = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
# Connectors whose decode side needs the prefill answer's kv_transfer_params (the params round trip); the
# others find the KV by the prompt itself (shared storage: ExampleConnector, LMCache).
PARAMS_ROUND_TRIP = frozenset({"NixlConnector", "MooncakeConnector", "MoRIIOConnector", "P2pNcclConnector"})


class PoolConfigError(ValueError):
    """A combination of pools and connectors that cannot run; `key` is the models[] key to blame."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KvTransfer(_Strict):
    """How KV moves from a prefill pool to a decode pool (vLLM's --kv-transfer-config)."""

    connector: str | None = Field(None, min_length=1, description=(
        "vLLM KV connector: NixlConnector (default on cuda), ExampleConnector (shared storage; the one that runs "
        "on vLLM's CPU build), MooncakeConnector, LMCacheConnectorV1, ...; the sim ignores it"))
    extra: dict[str, Any] = Field(default_factory=dict, description="the connector's kv_connector_extra_config")
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "other KVTransferConfig fields as-is (kv_buffer_device, kv_load_failure_policy, ...)"))
    kv_roles: dict[Literal["both", "prefill", "decode"], Literal["kv_producer", "kv_consumer", "kv_both"]] = Field(
        default_factory=dict, description="kv_role per pool role, when the connector's default is not wanted")
    link: LinkName = Field("rdma-400g", description=(
        "the network between the pools: what the sim spends moving KV and what the decision predicts"))

    def connector_for(self, device: str) -> str:
        return self.connector or ("NixlConnector" if device == "cuda" else "ExampleConnector")

    def kv_role(self, role: str) -> str:
        """vLLM's kv_role for a worker of pool `role`."""
        if role in self.kv_roles:
            return self.kv_roles[role]  # type: ignore[index]
        return _KV_ROLE_DEFAULT.get(role, "kv_both")


class EcTransfer(_Strict):
    """How the encode pool hands vision-encoder output to the others (vLLM's --ec-transfer-config)."""

    connector: str = Field("ECExampleConnector", min_length=1,
                           description="vLLM EC connector: ECExampleConnector (shared storage), ECMooncakeConnector, ...")
    extra: dict[str, Any] = Field(default_factory=dict, description="the connector's ec_connector_extra_config")
    options: dict[str, Any] = Field(default_factory=dict, description="other ECTransferConfig fields as-is")


class Pool(_Strict):
    """Replicas of one role; their flags, environment, GPUs and preset go over the model's."""

    role: WorkerRole
    replicas: int = Field(1, ge=0)
    engine_args: dict[str, Any] | list[str] = Field(
        default_factory=dict, description="merged over the model's engine_args (this pool's win)")
    env: dict[str, str] = Field(default_factory=dict, description="merged over the model's env")
    gpus_per_replica: int | None = Field(None, ge=0, description="default: the model's")
    preset: str | None = Field(None, description="sim engine: this pool's hardware preset (default: the model's)")


def check_pools(*, engine: str, device: str, gpus_per_replica: int, replicas_given: bool, pools: list[Pool],
                kv_transfer: KvTransfer | None, ec_transfer: EcTransfer | None) -> None:
    """Raise PoolConfigError (one sentence the config error shows) when these pools cannot run together."""
    roles = [p.role for p in pools]
    kinds = set(roles)

    def refuse(key: str, message: str) -> None:
        raise PoolConfigError(key, message)

    if pools and replicas_given:
        refuse("pools", "give either replicas or pools, not both (replicas is a single pool of role both)")
    for role in sorted(kinds):
        if roles.count(role) > 1:
            refuse("pools", f"one pool per role: role {role} appears {roles.count(role)} times")
    if "prefill" in kinds and not {"decode", "both"} & kinds:
        refuse("pools", "a prefill pool needs a decode (or both) pool to generate from the KV it computes")
    if "decode" in kinds and "prefill" not in kinds:
        refuse("pools", "a decode pool needs a prefill pool (or make it role both)")
    if "encode" in kinds and not kinds - {"encode"}:
        refuse("pools", "an encode pool needs a pool that generates (both, or prefill and decode)")
    if kinds - {"both"} and engine not in ("vllm", "sim"):
        refuse("pools", f"pools with roles other than both need engine vllm or sim, not {engine}")
    for pool in pools:
        gpus = gpus_per_replica if pool.gpus_per_replica is None else pool.gpus_per_replica
        if device == "cuda" and engine != "sim" and gpus < 1:
            refuse("pools", f"the {pool.role} pool runs on device cuda: it needs gpus_per_replica >= 1")
    if ec_transfer is not None and "encode" not in kinds:
        refuse("ec_transfer", "ec_transfer is set but there is no encode pool")
    if engine != "vllm":
        return  # the sim plays every role with NIXL's params round trip whatever the connector
    if kv_transfer is not None or {"prefill", "decode"} & kinds:
        kv = kv_transfer or KvTransfer()
        if device == "cpu" and kv.connector is None:
            refuse("kv_transfer", "device cpu: name kv_transfer.connector (ExampleConnector runs on vLLM's CPU "
                                  "build; NIXL needs a GPU)")
        if kv.connector_for(device) == "ExampleConnector" and not kv.extra.get("shared_storage_path"):
            refuse("kv_transfer", "ExampleConnector keeps KV in files: set kv_transfer.extra.shared_storage_path to "
                                  "a folder every pool of the model reads (the same one for prefill and decode)")
    if "encode" in kinds:
        ec = ec_transfer or EcTransfer()
        if ec.connector == "ECExampleConnector" and not ec.extra.get("shared_storage_path"):
            refuse("ec_transfer", "ECExampleConnector keeps encoder output in files: set "
                                  "ec_transfer.extra.shared_storage_path to a folder every pool of the model reads")
