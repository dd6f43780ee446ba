"""The code's shape, as the team's rules state it: dependency arrows one way (no import cycle in proxy/ or
backends/, imports under TYPE_CHECKING included; proxy/'s folders in one order of layers, each importing only
from its own layer and those below) and no module over 450 lines there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "backends")
MAX_LINES = 450

# proxy/'s layers, lowest first: a module imports from its own layer and those below, never above. The
# vocabulary is what every layer speaks (config, wire formats, errors); each later entry is a folder or, at the
# top, an entry point.
LAYERS = (
    {"errors", "engine_env", "kvevents", "identifiers", "routing_config", "protocol", "pools", "config", "gctuning",
     "promtext", "media_config", "cidrs"},
    {"tokens"},         # counting prompts as the engines do (a library: nothing of the proxy's state)
    {"request"},        # one parsed client request
    {"security"},       # who may call, what input may hold, secrets at rest
    {"workers"},        # registry, load view, breaker, health monitor, the Redis mirror
    {"routing"},        # policies, admission, the decision service, the live config
    {"observability"},  # metrics, traces, access log, the dashboard's feed
    {"dataplane"},      # the /v1 server and each request's journey
    {"api"},            # control plane, ops, dashboard routes
    {"app"}, {"cmd_proxy"}, {"fleet"}, {"cli"},
)


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (REPO / package).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of `known` that `path` imports anywhere (functions and `if TYPE_CHECKING:` blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & set(known)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for nxt in sorted(graph[module]):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done and (found := visit(nxt)) is not None:
                return found
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (found := visit(module)) is not None:
            return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_not_even_through_type_checking_imports(package):
    modules = _modules(package)
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_longer_than_the_limit(package):
    long = {str(p.relative_to(REPO)): n for p in _modules(package).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _layer(module: str) -> int:
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 else ""
    return next((i for i, layer in enumerate(LAYERS) if unit in layer), -1)


def test_every_import_in_proxy_goes_down_the_layers_or_stays_in_its_own():
    modules = _modules("proxy")
    unplaced = sorted(m for m in modules if m != "proxy" and _layer(m) < 0)
    assert unplaced == [], "place these in LAYERS"
    upward = sorted(f"{m} -> {i}" for m, path in modules.items() if m != "proxy"
                    for i in _imports(path, modules) if i != "proxy" and _layer(i) > _layer(m))
    assert upward == []


def test_the_check_finds_a_cycle_hidden_behind_type_checking(tmp_path):
    (tmp_path / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import X\n")
    (tmp_path / "high.py").write_text("from pkg.low import Y\n")
    known = {"pkg.low": tmp_path / "low.py", "pkg.high": tmp_path / "high.py"}
    graph = {name: _imports(path, known) - {name} for name, path in known.items()}
    assert _cycle(graph) in (["pkg.high", "pkg.low", "pkg.high"], ["pkg.low", "pkg.high", "pkg.low"])
