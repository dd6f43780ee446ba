"""config.yaml: the pydantic schema of a fleet and a loader that reports errors by key path and line.

Owns parsing, `${VAR}` / `${VAR:-default}` interpolation and validation; it does not
start anything. Every error reads like "models[1].replicas (line 14): must be >= 0".
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from proxy.cidrs import checked_cidrs
from proxy.engine_env import ENGINE_ENV_NAMES, ENGINE_ENV_PREFIXES, engine_env_allowed
from proxy.media_config import MediaUrlPolicy
from proxy.pools import EcTransfer, KvTransfer, Pool, PoolConfigError, check_pools
from proxy.routing_config import PolicyKnobs, RoutingConfig

# Loopback and the private ranges: where a fleet's workers live unless the operator says otherwise
# (proxy/security/networks.py enforces proxy.worker_networks).
DEFAULT_WORKER_NETWORKS: tuple[str, ...] = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12",
                                            "192.168.0.0/16", "fc00::/7")

PolicyName = str  # validated against proxy.routing's registry by the proxy at start-up
EngineKind = Literal["vllm", "turbomind", "sim"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key path and line of each problem."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems) if len(problems) == 1
                         else f"{source}:\n  " + "\n  ".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Timeouts(_Strict):
    connect_s: float = Field(5.0, gt=0)
    first_byte_s: float = Field(300.0, gt=0, description="request sent -> first response byte")
    idle_s: float = Field(120.0, gt=0, description="longest silence between two streamed chunks")
    total_s: float | None = Field(3600.0, gt=0, description="non-streamed request sent -> whole answer received; "
                                                             "null: no limit")
    kv_transfer_s: float = Field(60.0, gt=0, description=(
        "a request split across a prefill and a decode worker: the prefill worker's answer, then the decode "
        "worker's first byte (the KV pulled), each within this (the second at most first_byte_s); past it the "
        "stage goes to another worker"))
    stall_min_s: float = Field(2.0, gt=0, description=(
        "the least silence (no byte on its connections, its engine's progress counters still) of a worker holding "
        "requests before the proxy probes it, more for an engine whose measured steps are slow, at most idle_s; "
        "one that does not answer is stalled: no new work, its requests move to other workers (streams migrate), "
        "unless it is the last worker of its model"))


class AdmissionQueue(_Strict):
    """Requests the proxy holds (every engine already queueing, or no worker started yet), per model, FIFO."""

    max_length: int = Field(256, ge=0, description="requests waiting per model before 429")
    max_wait_s: float = Field(30.0, gt=0, description="longest wait in the queue before 503")


class StaticWorker(_Strict):
    url: str
    models: list[str] = Field(default_factory=list, description="empty: probe the worker's /v1/models")
    engine: Literal["vllm", "turbomind", "pytorch", "sim", "unknown"] = "unknown"


class ApiKey(_Strict):
    """One client API key for /v1/*: the key itself or its SHA-256, with optional allowlist and limits."""

    key: str | None = Field(None, min_length=1, description="the key clients send as Authorization: Bearer KEY")
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$",
                                   description="hex SHA-256 of the key, to keep the key itself out of the config")
    name: str | None = Field(None, description="shown in logs and metrics instead of the key")
    models: list[str] = Field(default_factory=list, description="models or aliases this key may use; empty: all")
    requests_per_s: float | None = Field(None, gt=0, description="token bucket: sustained requests/s, burst of 1 s")
    tokens_per_min: float | None = Field(None, gt=0,
                                         description="token bucket on estimated prompt + max output tokens per min")

    @model_validator(mode="after")
    def _one_secret(self) -> ApiKey:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of 'key' or 'key_sha256'")
        return self


class RequestLimits(_Strict):
    """Limits on one request's shape; each may be overridden per model (models[].limits)."""

    max_messages: int | None = Field(None, ge=1, description="messages per chat request (default 2048)")
    max_images: int | None = Field(None, ge=0, description="images per request (default 64)")
    max_videos: int | None = Field(None, ge=0, description="videos per request (default 8)")
    max_image_pixels: int | None = Field(
        None, ge=1, description="total pixels of the images whose size the proxy can read (data: URLs); "
                                "default 268435456 = 16 images at Qwen3-VL's 16M max_pixels")
    max_tokens: int | None = Field(None, ge=1, description="cap on max_tokens / max_completion_tokens (default: none)")


class ProxyLimits(RequestLimits):
    """Limits against hostile or broken callers (defaults apply to fields left unset)."""

    max_header_bytes: int = Field(32 * 1024, ge=1024, description="all request header lines together; beyond: 431")
    max_headers: int = Field(100, ge=8, description="header fields per request; beyond: 431")
    header_read_timeout_s: float = Field(10.0, gt=0, description="connection open -> headers complete; beyond: 408")
    body_read_timeout_s: float = Field(60.0, gt=0, description="headers complete -> body complete; beyond: 408")
    max_workers: int = Field(1024, ge=1, description="registered workers; further registrations get 503")
    max_client_connections: int = Field(4096, ge=1,
                                        description="open client connections; further ones are closed at once")
    max_buffered_body_bytes: int = Field(512 * 1024 * 1024, ge=1024 * 1024,
                                         description="request bodies held in memory at once, all requests together")
    buffered_body_wait_s: float = Field(5.0, ge=0,
                                        description="a body that does not fit waits this long for room, then 503")
    max_connections_per_client: int = Field(1024, ge=1, description=(
        "open connections from one client address (loopback included; an IPv6 client by its /64); further ones "
        "get 429 and are closed. Behind a load balancer that does not keep client addresses, raise it"))
    max_migration_text_bytes: int = Field(4 * 1024 * 1024, ge=0, description=(
        "streamed text kept per stream so it can move to another worker mid-stream; a longer answer is still "
        "relayed whole, but ends with an error event if its worker fails"))


class ProxyConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    policy: PolicyName = "kv_aware"
    admin_token: str | None = Field(None, description=(
        "guards /workers, /nodes, /fleet; unset: `kvroute up` / `kvroute proxy` make one in a 0600 file"))
    worker_token: str | None = Field(None, description="lets workers register (each then gets its own secret)")
    worker_networks: list[str] = Field(
        default_factory=lambda: list(DEFAULT_WORKER_NETWORKS),
        description="CIDRs a registered worker URL may resolve to; anything else is refused (403)")
    trusted_worker_networks: list[str] = Field(
        default_factory=list, description="CIDRs whose callers may register workers without a token (LMDeploy)")
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        "names besides this machine's own that a token-less control request's Host may carry (DNS rebinding "
        "guard); '*' turns the check off"))
    insecure_open_control_plane: bool = Field(
        False, description="serve the control plane to everyone off loopback without an admin token (warned)")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    retries: int = Field(2, ge=0, le=10)
    migrations: int = Field(2, ge=0, le=10, description=(
        "times one stream may move to another worker after its worker failed mid-stream (0: end it with an "
        "error event)"))
    kv_high_water: float = Field(1.0, gt=0, le=1.0, description=(
        "1.0 (default): off. Below 1.0, hold requests while every worker's projected KV usage is at or above it: "
        "fewer preemptions, but the engines idle while the proxy waits (see proxy/routing/admission.py)"))
    timeouts: Timeouts = Field(default_factory=Timeouts)
    queue: AdmissionQueue = Field(default_factory=AdmissionQueue)
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description=(
        "the policies' knobs, the estimator's priors, admission's rules, the prefix index (proxy/routing_config.py)"))
    static_workers: list[StaticWorker] = Field(default_factory=list)
    drain_grace_s: float = Field(30.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    api_keys: list[ApiKey] | str | None = Field(
        None, description="client API keys for /v1/*: a list (of keys as plain strings, as vLLM's --api-key takes "
                          "them, or entries), or a file (one key or sha256:HEX per line, or a YAML list of entries); "
                          "also --api-keys FILE and KVROUTE_API_KEYS (comma-separated)")
    metrics_token: str | None = Field(None, description="bearer token for GET /metrics besides any API key")
    otlp_endpoint: str | None = Field(None, description=(
        "OpenTelemetry collector (OTLP/HTTP, e.g. http://127.0.0.1:4318): one trace per /v1 request; unset: "
        "OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing"))
    access_log: bool = Field(True, description="one JSON line per /v1 request on the kvroute.access logger (INFO)")
    limits: ProxyLimits = Field(default_factory=ProxyLimits)
    media_urls: MediaUrlPolicy = Field(default_factory=MediaUrlPolicy)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _plain_keys(cls, v: Any) -> Any:
        """`api_keys: [sk-abc, {key_sha256: ..., models: [...]}]`: a plain string is a key of its own."""
        if isinstance(v, list):
            return [{"key": str(item)} if isinstance(item, str | int) and not isinstance(item, bool) else item
                    for item in v]
        return v

    @field_validator("admin_token", "worker_token")
    @classmethod
    def _empty_token_is_none(cls, v: str | None) -> str | None:
        return v if v is not None and v.strip() else None  # `${KVROUTE_ADMIN_TOKEN:-}` unset means no token

    @field_validator("worker_networks", "trusted_worker_networks")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        return checked_cidrs(v)


class StateTLS(_Strict):
    """TLS to Redis (a rediss:// URL turns it on with the system's CAs)."""

    ca_file: str | None = Field(None, description="CA bundle that signed Redis's certificate")
    cert_file: str | None = Field(None, description="client certificate, when Redis asks for one")
    key_file: str | None = Field(None, description="its private key")
    check_hostname: bool = True


class StateConfig(_Strict):
    url: str = Field("memory", description="'memory' or redis://host:port/db")
    username: str | None = Field(None, description="Redis ACL user (with password)")
    password: str | None = Field(None, repr=False, description="Redis AUTH password, e.g. ${KVROUTE_REDIS_PASSWORD}")
    tls: StateTLS | None = Field(None, description="TLS options for Redis; set: TLS on")
    secret_key: str | None = Field(None, repr=False, min_length=16, description=(
        "encrypts the engine API keys kept in Redis (AES-GCM); replicas must share it. Unset: derived from "
        "proxy.admin_token"))
    ray_address: str | None = Field(None, description="Ray cluster for placement: ray (e.g. 'auto')")
    ray_gpu_resource: str = Field("GPU", min_length=1,
                                  description="Ray resource a replica holds gpus_per_replica of; 'GPU' = num_gpus")

    @field_validator("url")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be 'memory' or a redis:// URL")
        return v


EngineArgs = dict[str, str | int | float | bool | list[str | int | float] | None] | list[str]


class ModelConfig(_Strict):
    name: str = Field(..., min_length=1)
    aliases: list[str] = Field(default_factory=list)
    engine: EngineKind
    model: str | None = Field(None, description="checkpoint path or id; sim: optional")
    replicas: int = Field(1, ge=0)
    gpus_per_replica: int = Field(0, ge=0)
    placement: Literal["local", "ray"] = "local"
    device: Literal["cuda", "cpu"] = "cuda"
    engine_args: EngineArgs = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    policy: PolicyName | None = None
    routing: PolicyKnobs = Field(default_factory=PolicyKnobs,
                                 description="this model's own policy knobs, each over proxy.routing's")
    preset: str | None = Field(None, description="sim engine: hardware/model preset")
    startup_timeout_s: float = Field(600.0, gt=0)
    limits: RequestLimits = Field(default_factory=RequestLimits,
                                  description="overrides proxy.limits for this model")
    # disaggregated serving (proxy/pools.py): replicas by role, and how KV / encoder output move between them
    pools: list[Pool] = Field(default_factory=list, description="replicas by role instead of `replicas`")
    kv_transfer: KvTransfer | None = None
    ec_transfer: EcTransfer | None = None

    def pool_list(self) -> list[Pool]:
        """The pools to run: `pools`, or `replicas` as one pool of role both."""
        return list(self.pools) or [Pool(role="both", replicas=self.replicas)]

    @model_validator(mode="after")
    def _pools_fit(self) -> ModelConfig:
        loc: tuple[str | int, ...] = ("pools",)
        try:
            for i, pool in enumerate(self.pools):
                loc = ("pools", i, "env")
                self._engine_env_only(pool.env)
            loc = ("pools",)
            check_pools(engine=self.engine, device=self.device, gpus_per_replica=self.gpus_per_replica,
                        replicas_given="replicas" in self.model_fields_set, pools=self.pools,
                        kv_transfer=self.kv_transfer, ec_transfer=self.ec_transfer)
        except ValueError as exc:  # blamed on the key it is about (one that is set), so the error names its line
            if isinstance(exc, PoolConfigError):
                loc = (exc.key,) if exc.key in self.model_fields_set else ("pools",)
            raise ValidationError.from_exception_data("ModelConfig", [InitErrorDetails(
                type=PydanticCustomError("pools", str(exc)), loc=loc, input=None)]) from None
        return self

    @field_validator("env")
    @classmethod
    def _engine_env_only(cls, v: dict[str, str]) -> dict[str, str]:
        refused = sorted(name for name in v if not engine_env_allowed(name))
        if refused:
            raise ValueError(f"env may set only what engines read ({', '.join(ENGINE_ENV_PREFIXES)}* and "
                             f"{', '.join(sorted(ENGINE_ENV_NAMES))}); refused: {', '.join(refused)[:200]} "
                             "(set anything else in kvroute's own environment)")
        return v

    @model_validator(mode="after")
    def _engine_needs(self) -> ModelConfig:
        if self.engine in ("vllm", "turbomind") and not self.model:
            raise ValueError(f"engine {self.engine} needs 'model' (a checkpoint path)")
        if self.engine == "turbomind" and self.device != "cuda":
            raise ValueError("engine turbomind runs only on device cuda")
        if self.device == "cuda" and self.engine != "sim" and self.gpus_per_replica < 1:
            raise ValueError("device cuda needs gpus_per_replica >= 1")
        return self

    def engine_arg_list(self) -> list[str]:
        """engine_args as command-line flags: {max-num-seqs: 8, enforce-eager: true} -> [...]."""
        if isinstance(self.engine_args, list):
            return list(self.engine_args)
        out: list[str] = []
        for key, value in self.engine_args.items():
            flag = "--" + key.replace("_", "-")
            if value is None or value is False:
                continue
            if value is True:
                out.append(flag)
            elif isinstance(value, list):
                out += [flag, *(str(v) for v in value)]
            else:
                out += [flag, str(value)]
        return out


class FleetConfig(_Strict):
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    models: list[ModelConfig] = Field(default_factory=list)

    @field_validator("state", mode="before")
    @classmethod
    def _state_shorthand(cls, v: Any) -> Any:
        return {"url": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _unique_names(self) -> FleetConfig:
        seen: dict[str, str] = {}
        for m in self.models:
            for name in [m.name, *m.aliases]:
                if name in seen:
                    raise ValueError(f"model name or alias '{name}' is used by both {seen[name]} and {m.name}")
                seen[name] = m.name
        for i, m in enumerate(self.models):
            if m.placement == "ray" and not self.state.ray_address:
                raise ValueError(f"models[{i}] ({m.name}) has placement ray but state.ray_address is not set")
        return self

    def model(self, name_or_alias: str) -> ModelConfig | None:
        for m in self.models:
            if name_or_alias == m.name or name_or_alias in m.aliases:
                return m
        return None


# --- loading -----------------------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(text: str, env: dict[str, str], path: str, line: int, problems: list[str]) -> str:
    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append(f"{path} (line {line}): environment variable {name} is not set and has no default")
        return ""

    return _VAR.sub(sub, text)


def _to_python(node: yaml.Node, path: str, lines: dict[str, int], env: dict[str, str],
               problems: list[str]) -> Any:
    """Turn a composed YAML node into plain data, recording the line of every key path."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            child = f"{path}.{key}" if path else str(key)
            if key in out:
                problems.append(f"{child} (line {key_node.start_mark.line + 1}): duplicate key")
            out[key] = _to_python(value_node, child, lines, env, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, f"{path}[{i}]", lines, env, problems) for i, v in enumerate(node.value)]
    assert isinstance(node, yaml.ScalarNode)
    value = yaml.SafeLoader("").construct_object(node, deep=True)
    if isinstance(value, str) and "${" in value:
        value = _interpolate(value, env, path, lines[path], problems)
        if not node.style:  # a plain scalar takes its type after substitution: "${N:-8}" -> 8
            value = yaml.safe_load(value) if value.strip() else ""
    return value


def _error_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none")):
            continue  # pydantic's union-branch labels ("list[str]", "str") are noise to a reader
        else:
            path += f".{part}" if path else str(part)
    return path


def _line_for(path: str, lines: dict[str, int]) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = re.sub(r"(\.[^.\[]+|\[\d+\])$", "", path)
    return lines.get("")


def parse_config(text: str, source: str = "config", env: dict[str, str] | None = None) -> FleetConfig:
    """Parse YAML text into a FleetConfig, or raise ConfigError naming path and line."""
    env = dict(os.environ) if env is None else env
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError([f"({where}): invalid YAML: {getattr(exc, 'problem', exc)}"], source) from None
    if root is None:
        return FleetConfig()
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError([f"(line {root.start_mark.line + 1}): the top level must be a mapping"], source)
    lines: dict[str, int] = {}
    problems: list[str] = []
    data = _to_python(root, "", lines, env, problems)
    if problems:
        raise ConfigError(problems, source)
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            path = _error_path(err["loc"])
            line = _line_for(path, lines)
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            elif msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            elif err["type"] in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
                msg = (msg.replace("Input should be", "must be").replace("greater than or equal to", ">=")
                       .replace("less than or equal to", "<=").replace("greater than", ">").replace("less than", "<"))
            where = f"{path} (line {line})" if path else f"(line {line})"
            problems.append(f"{where}: {msg}")
        raise ConfigError(list(dict.fromkeys(problems)), source) from None


def load_config(path: str | os.PathLike[str], env: dict[str, str] | None = None) -> FleetConfig:
    """Read and parse a config file (blocking file I/O: call at start-up or via a thread)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror}"], str(p)) from None
    return parse_config(text, source=str(p), env=env)
