"""How the benchmarks turn a kvroute route spec into a proxy command: knobs, the default policy, other trees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.fleet import default_policy, kvroute_command, resolve_default


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


def test_a_tree_knob_with_module_knobs_patches_that_trees_modules(tmp_path):
    tree = _tree(tmp_path / "other", "other")
    _, argv = kvroute_command(f"kv_aware@tree={tree}+inflight_weight=0.1", 8123, tmp_path / "logs")
    out = _run(argv)
    assert "ABLATE other " in out
    assert "proxy.routing.kv_aware.INFLIGHT_WEIGHT=0.1" in out and "'--', 'proxy'" in out


def test_a_tree_that_is_not_a_kvroute_checkout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a kvroute source tree"):
        kvroute_command(f"kv_aware@tree={tmp_path}", 8123, tmp_path / "logs")
    _, argv = kvroute_command("kv_aware", 8123, tmp_path / "logs")
    assert argv[:3] == [sys.executable, "-m", "proxy.cli"]  # without the knob: this repository's proxy
