"""deploy/: Kubernetes manifests match the Kubernetes schema, their commands are real kvroute command
lines, systemd units start real commands, and the example fleets load and fit their hardware."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import kubernetes  # the dev extra installs the kubernetes client (make setup)
import pytest
import yaml

from proxy.cli import build_parser
from proxy.config import load_config, parse_config
from proxy.fleet.gpus import plan_assignment
from proxy.fleet.launcher import pools_of
from proxy.fleet.reconcile import local_gpu_demands

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
ENV = {"KVROUTE_ADMIN_TOKEN": "a", "KVROUTE_WORKER_TOKEN": "w", "KVROUTE_REDIS_PASSWORD": "r",
       "KVROUTE_STATE_KEY": "s" * 32}


def docs() -> list[tuple[str, dict]]:
    return [(f"{p.name}#{i}", d) for p in MANIFESTS for i, d in enumerate(yaml.safe_load_all(p.read_text())) if d]


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in docs() if d["kind"] == kind]


@pytest.mark.parametrize("name,doc", docs(), ids=[n for n, _ in docs()])
def test_manifest_matches_the_kubernetes_schema(name, doc):
    api = kubernetes.client.ApiClient()
    model = api._ApiClient__deserialize(doc, "V1" + doc["kind"])  # required fields and types are checked here
    # A key the schema does not know is dropped by the models: an exact round trip proves there is none.
    assert api.sanitize_for_serialization(model) == doc


def test_the_manifests_include_what_a_fleet_needs():
    kinds = sorted(d["kind"] for _, d in docs())
    assert kinds.count("StatefulSet") >= 1 and "Deployment" in kinds and "Service" in kinds
    assert any("redis" in d["metadata"]["name"] for d in by_kind("Deployment"))


def test_every_service_selects_pods_that_exist():
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in by_kind("Deployment") + by_kind("StatefulSet")]
    for svc in by_kind("Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= labels.items() for labels in pod_labels), f"{svc['metadata']['name']} selects nothing"


def _container_argv(doc: dict) -> list[str]:
    c = doc["spec"]["template"]["spec"]["containers"][0]
    return [*c["command"], *c.get("args", [])]


def _parse_kvroute(argv: list[str]):
    assert Path(argv[0]).name == "kvroute", argv
    return build_parser().parse_args(argv[1:])


@pytest.mark.parametrize("sts", by_kind("StatefulSet"), ids=lambda d: d["metadata"]["name"])
def test_worker_statefulset_self_registers_on_its_gpus(sts):
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1 and c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"]
    env = {e["name"]: e for e in c["env"]}
    assert env["KVROUTE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    proxy_host_port = env["KVROUTE_PROXY_URL"]["value"].removeprefix("http://")
    services = {(s["metadata"]["name"], p["port"]) for s in by_kind("Service") for p in s["spec"]["ports"]}
    host, port = proxy_host_port.split(":")
    assert (host, int(port)) in services, "KVROUTE_PROXY_URL names no Service"
    args = _parse_kvroute(_container_argv(sts))
    assert args.command == "worker" and args.advertise_url == f"http://$(POD_IP):{args.port}"
    engine_args = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    assert f"--tensor-parallel-size={gpus}" in engine_args
    assert pod["terminationGracePeriodSeconds"] > args.drain_grace_s, "the drain would be cut short"


def test_proxy_configmap_is_a_valid_fleet_config():
    (cm,) = by_kind("ConfigMap")
    cfg = parse_config(cm["data"]["config.yaml"], env=ENV)
    assert cfg.proxy.host == "0.0.0.0" and cfg.state.url.startswith("redis://")
    (redis_svc,) = [s for s in by_kind("Service") if "redis" in s["metadata"]["name"]]
    assert redis_svc["metadata"]["name"] in cfg.state.url


def _env_from_secrets(container: dict) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


def test_redis_takes_a_password_the_proxies_have_and_answers_only_the_proxies():
    # Issue 33, item 8: the manifest ran Redis with no password and no network policy.
    (redis_dep,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "kvroute-redis"]
    (proxy_dep,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "kvroute-proxy"]
    redis_c, proxy_c = redis_dep["spec"]["template"]["spec"]["containers"][0], \
        proxy_dep["spec"]["template"]["spec"]["containers"][0]
    args = redis_c["args"]
    password_var = args[args.index("--requirepass") + 1].removeprefix("$(").removesuffix(")")
    secret = _env_from_secrets(redis_c)[password_var]
    assert secret[0] in {s["metadata"]["name"] for s in by_kind("Secret")}
    (cm,) = by_kind("ConfigMap")
    state_text = cm["data"]["config.yaml"].split("state:", 1)[1]
    proxy_var = re.search(r"password: \$\{(\w+)\}", state_text).group(1)
    assert _env_from_secrets(proxy_c)[proxy_var] == secret  # the same Secret's value on both sides
    cfg = parse_config(cm["data"]["config.yaml"], env=ENV)
    assert cfg.state.password == ENV[proxy_var] and cfg.state.secret_key
    (policy,) = [p for p in by_kind("NetworkPolicy") if p["metadata"]["name"] == "kvroute-redis"]
    assert policy["spec"]["podSelector"]["matchLabels"] == redis_dep["spec"]["template"]["metadata"]["labels"]
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"] == proxy_dep["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_proxy_deployment_runs_a_real_command():
    (dep,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "kvroute-proxy"]
    args = _parse_kvroute(_container_argv(dep))
    assert args.command == "proxy" and args.config == "/etc/kvroute/config.yaml"
    (cm,) = by_kind("ConfigMap")
    mounts = dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(v["mountPath"] == "/etc/kvroute" for v in mounts) and "config.yaml" in cm["data"]


def _unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string((DEPLOY / "systemd" / name).read_text())
    return cp


def test_systemd_worker_unit_starts_a_real_worker_command():
    unit = _unit("kvroute-worker@.service")
    svc = unit["Service"]
    assert svc["KillMode"] == "mixed" and svc["KillSignal"] == "SIGTERM"  # SIGTERM to the worker only: it drains
    sample = {"KVROUTE_ENGINE": "vllm", "KVROUTE_PORT": "8101", "KVROUTE_ADVERTISE_URL": "http://h:8101",
              "KVROUTE_SERVED_MODEL_NAME": "qwen3-vl-8b", "KVROUTE_MODEL": "/models/q", "KVROUTE_GPUS": "0,1",
              "KVROUTE_ENGINE_ARGS": "--max-model-len 32768"}
    # systemd's rules: ${VAR} is one word, $VAR splits on whitespace.
    line = re.sub(r"\$\{(\w+)\}", lambda m: shlex.quote(sample[m.group(1)]), svc["ExecStart"])
    line = re.sub(r"\$(\w+)", lambda m: sample[m.group(1)], line)
    args = _parse_kvroute(shlex.split(line))
    assert args.command == "worker" and args.gpus == "0,1" and args.port == 8101
    assert args.engine_args == ["--", "--max-model-len", "32768"]
    assert float(svc["TimeoutStopSec"]) > args.drain_grace_s


def test_systemd_proxy_unit_is_well_formed():
    unit = _unit("kvroute-proxy.service")
    assert unit["Service"]["ExecStart"].split()[1:3] == ["proxy", "--config"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_8xh100_example_loads_and_fits_eight_gpus():
    cfg = load_config(DEPLOY / "examples" / "8xh100.yaml", env=ENV)
    plan = plan_assignment(local_gpu_demands(cfg), [str(i) for i in range(8)])
    used = [g for groups in plan.values() for group in groups for g in group]
    assert sorted(used, key=int) == [str(i) for i in range(8)]  # every GPU used once
    assert plan["qwen3-vl-32b"] == [["0", "1"], ["2", "3"]]


def test_8xh100_pd_example_loads_and_gives_each_pool_its_gpus_and_role():
    cfg = load_config(DEPLOY / "examples" / "8xh100-pd.yaml", env=ENV)
    plan = plan_assignment(local_gpu_demands(cfg), [str(i) for i in range(8)])
    assert {pool: len(groups) for pool, groups in plan.items()} == {
        "qwen3-vl-8b/prefill": 2, "qwen3-vl-8b/decode": 5, "qwen3-vl-8b/encode": 1}
    kinds = {p.role: p.model.kv_transfer.kv_role(p.role) for p in pools_of(cfg.models[0]) if p.role != "encode"}
    assert kinds == {"prefill": "kv_producer", "decode": "kv_consumer"}


def test_two_nodes_ray_example_loads():
    cfg = load_config(DEPLOY / "examples" / "two-nodes-ray.yaml", env={**ENV, "RAY_ADDRESS": "10.0.0.1:6379"})
    assert cfg.state.ray_address == "10.0.0.1:6379"
    assert all(m.placement == "ray" for m in cfg.models)
    assert local_gpu_demands(cfg) == []  # Ray, not this machine, provides the GPUs


def test_readme_example_config_loads():
    text = (DEPLOY / "README.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = parse_config(block, env=ENV)
    assert cfg.models
