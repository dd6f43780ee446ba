"""How the benchmarks turn a kvroute route spec into a proxy command: knobs (a config file, process settings),
the default policy, other trees; and a peer route into the peer's command (vllm-router:kv_aware's event sources)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backends.sim.kv_publisher import binds, kv_event_configs
from bench.fleet import (
    Fleet,
    SimWorkerSpec,
    default_policy,
    kvroute_command,
    reads_kv_events,
    resolve_default,
)
from bench.peers import router_command
from bench.route_spec import parse_route_spec
from proxy.config import load_config


def test_default_with_knobs_is_the_default_policy_with_those_knobs():
    assert resolve_default("default") == default_policy()
    assert resolve_default("") == default_policy()
    assert resolve_default("default@inflight_weight=0.1") == f"{default_policy()}@inflight_weight=0.1"
    assert resolve_default("round_robin@hw=1.0") == "round_robin@hw=1.0"


def _tree(root: Path, label: str) -> Path:
    """A source tree whose proxy.cli and bench.ablate say which tree and which arguments ran them."""
    for package, module, says in (("proxy", "cli.py", "TREE"), ("bench", "ablate.py", "ABLATE")):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / module).write_text(
            f"import sys\nif __name__ == '__main__':\n    print({says!r}, {label!r}, 'ARGS', sys.argv[1:])\n")
    return root


def _run(argv: list[str]) -> str:
    repo = Path(__file__).resolve().parents[2]  # the benchmarks run their commands from the repository
    done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_tree_knob_runs_the_proxy_of_that_tree_with_the_same_arguments(tmp_path):
    tree = _tree(tmp_path / "other", "other")
    policy, argv = kvroute_command(f"kv_aware@tree={tree}", 8123, tmp_path / "logs")
    assert policy == "kv_aware"
    out = _run(argv)
    assert "TREE other " in out  # not this repository's proxy, though the command runs from it
    assert "'--port', '8123'" in out and "'--policy', 'kv_aware'" in out


def test_a_tree_knob_with_process_settings_sets_them_in_that_trees_proxy(tmp_path):
    tree = _tree(tmp_path / "other", "other")
    _, argv = kvroute_command(f"kv_aware@tree={tree}+gc_freeze=False", 8123, tmp_path / "logs")
    out = _run(argv)
    assert "ABLATE other " in out
    assert "proxy.gctuning.FREEZE_AT_START=False" in out and "'--', 'proxy'" in out


def _config_of(argv: list[str]) -> dict:
    return json.loads(Path(argv[argv.index("--config") + 1]).read_text())


def test_routing_knobs_go_into_the_config_file_the_proxy_starts_with(tmp_path):
    policy, argv = kvroute_command("kv_aware@prefix_weight=0+hw=1.0+admission.admit_after_head=true",
                                   8123, tmp_path / "logs")
    assert policy == "kv_aware" and argv[:3] == [sys.executable, "-m", "proxy.cli"]  # no patching
    assert _config_of(argv) == {"proxy": {"kv_high_water": 1.0, "routing": {
        "kv_aware": {"prefix_weight": 0}, "admission": {"admit_after_head": True}}}}
    # the file is what an operator's config.yaml would say: the proxy's own loader reads it
    config = load_config(argv[argv.index("--config") + 1])
    assert config.proxy.routing.kv_aware.prefix_weight == 0 and config.proxy.routing.admission.admit_after_head


def test_a_knob_name_is_its_config_key_in_the_routes_own_policy_first():
    assert parse_route_spec("kv_aware@shortlist=4").proxy == {"routing": {"kv_aware": {"shortlist": 4}}}
    assert parse_route_spec("kv_cost@shortlist=4").proxy == {"routing": {"kv_cost": {"shortlist": 4}}}
    assert parse_route_spec("kv_cost@inflight_weight=0.1").proxy == {"routing": {"kv_aware": {"inflight_weight": 0.1}}}
    assert parse_route_spec("kv_aware@queue.max_wait_s=5").proxy == {"queue": {"max_wait_s": 5}}
    # the names earlier runs' commands used (bench/results/) still set the same thing
    assert parse_route_spec("kv_aware@admit_above_kv=0.5+admit_prefill=0").proxy == {"routing": {"admission": {
        "confirm_above_kv_usage": 0.5, "confirm_above_prefill_tokens": 0}}}
    assert parse_route_spec("kv_aware@report_interval=0.1").process == ["proxy.protocol.REPORT_INTERVAL_S=0.1"]


@pytest.mark.parametrize(("spec", "message"), [
    ("kv_aware@prefix_wieght=0", r"unknown knob 'prefix_wieght'"),
    ("round_robin@shortlist=4", r"'shortlist' .* is a key of kv_aware, kv_cost, disagg: say which"),
    ("kv_aware@prefix_weight=-1", r"proxy\.routing\.kv_aware\.prefix_weight \(line 1\): must be >= 0"),
    ("kv_aware@kv_cost.shortlist_over=4", r"proxy\.routing\.kv_cost\.shortlist_over \(line 1\): unknown key"),
])
def test_a_knob_the_config_would_refuse_is_refused_before_anything_starts(tmp_path, spec, message):
    with pytest.raises(ValueError, match=message):
        kvroute_command(spec, 8123, tmp_path / "logs")
    assert not (tmp_path / "logs").exists()


def test_ablate_sets_only_process_settings():
    done = subprocess.run([sys.executable, "-m", "bench.ablate", "proxy.routing.kv_aware.PREFIX_WEIGHT=0", "--",
                           "--help"], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "not a process setting" in done.stderr


def test_a_tree_that_is_not_a_kvroute_checkout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a kvroute source tree"):
        kvroute_command(f"kv_aware@tree={tmp_path}", 8123, tmp_path / "logs")
    _, argv = kvroute_command("kv_aware", 8123, tmp_path / "logs")
    assert argv[:3] == [sys.executable, "-m", "proxy.cli"]  # without the knob: this repository's proxy


def test_vllm_router_kv_aware_connects_to_where_each_sim_publishes_and_no_other_route_gets_sources(tmp_path):
    fleet = Fleet(tmp_path, [SimWorkerSpec(model="m"), SimWorkerSpec(model="m")], kv_events=True)
    configs = [kv_event_configs(fleet.publisher_config())[0] for _ in fleet.workers]  # what Fleet.start gives each
    fleet.urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    sources = fleet.kv_event_sources()
    argv = router_command(Path("/venv"), "vllm-router", "kv_aware", fleet.urls, 9000, 9100, sources)

    def flags(name: str) -> list[str]:
        return [argv[i + 1] for i, a in enumerate(argv) if a == name]

    for url, config, (events, replay) in zip(fleet.urls, configs, fleet.event_endpoints, strict=True):
        assert binds(config["endpoint"]) and config["topic"] == ""  # the sim binds; vllm-router hears topic "" only
        assert events.rpartition(":")[2] == config["endpoint"].rpartition(":")[2]
        assert replay.rpartition(":")[2] == config["replay_endpoint"].rpartition(":")[2]
        assert f"{url}={events}" in flags("--kv-event-source")
        assert f"{url}={replay}" in flags("--kv-event-replay-source")
    assert flags("--kv-event-block-size") == ["16"] and flags("--kv-event-model") == ["m"]
    assert reads_kv_events("vllm-router", "kv_aware") and not reads_kv_events("vllm-router", "cache_aware")
    assert "--kv-event-source" not in router_command(Path("/venv"), "vllm-router", "cache_aware", fleet.urls, 1, 2)
    with pytest.raises(ValueError, match="kv_aware only"):
        router_command(Path("/venv"), "vllm-router", "kv_aware", fleet.urls, 1, 2)  # no sources: refused
    with pytest.raises(ValueError, match="kv_aware only"):
        router_command(Path("/venv"), "sglang-router", "cache_aware", fleet.urls, 1, 2, sources)
