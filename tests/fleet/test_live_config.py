"""Live config under `kvroute up`: a file edit or `kvroute apply` changes aliases, /v1/models, per-model
policies and the live proxy keys at once, names the keys that need a restart, and `kvroute scale` writes
its count back into the file (comments kept), so the next edit does not undo it."""

from __future__ import annotations

import subprocess
import textwrap

import httpx
import pytest

from tests.fleet.support import Fleet
from tests.support.procs import KVROUTE, wait_until

pytestmark = pytest.mark.timeout(240)

BEFORE = """\
# the operator's notes stay in the file
proxy:
  drain_grace_s: 5
models:
  - name: tiny
    engine: sim
    preset: cpu-tiny
    device: cpu
    replicas: 1   # one for now
    engine_args: {time-scale: 20}
"""


def _decisions_by_policy(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {line.split('policy="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("kvroute:routing_decisions_total{")}


def _models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]}


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


def test_file_edits_and_apply_change_models_policies_and_live_keys_and_scale_is_written_back(procs, tmp_path):
    fleet = Fleet(procs, tmp_path, BEFORE)
    try:
        fleet.wait_workers({"tiny-0"})
        assert _chat(fleet.url, "tiny").status_code == 200
        assert _models(fleet.url) == {"tiny"}

        # a file edit: an alias, a per-model policy, a live proxy key and one that needs a restart
        edited = BEFORE.replace("    replicas: 1", "    aliases: [small]\n    policy: round_robin\n    replicas: 1")
        edited = edited.replace("  drain_grace_s: 5", "  drain_grace_s: 5\n  retries: 4\n  max_body_bytes: 2000000")
        fleet.write_config(edited)
        wait_until(lambda: _models(fleet.url) == {"tiny", "small"}, 20, what="the new alias in /v1/models")
        assert _chat(fleet.url, "small").status_code == 200
        assert "round_robin" in _decisions_by_policy(fleet.url)

        # `kvroute apply` of another file says what changed live and what waits for a restart
        other = tmp_path / "other.yaml"
        other.write_text(edited.replace("  retries: 4", "  retries: 1\n  queue: {max_wait_s: 12}\n"
                                                      "  routing: {kv_aware: {queue_weight: 0.05}}"))
        applied = subprocess.run([*KVROUTE, "apply", str(other), "--proxy", fleet.url], capture_output=True,
                                 text=True, timeout=60)
        assert applied.returncode == 0, applied.stderr
        assert "proxy: changed live: proxy.retries, proxy.queue, proxy.routing" in applied.stdout
        assert "need a restart of the proxy: proxy.max_body_bytes" in applied.stdout

        # `kvroute scale` writes the count into the watched file, keeping its comments
        scaled = subprocess.run([*KVROUTE, "scale", "small", "2", "--proxy", fleet.url], capture_output=True,
                                text=True, timeout=60)
        assert scaled.returncode == 0, scaled.stderr
        assert "config file:" in scaled.stdout and "(comments kept)" in scaled.stdout
        text = fleet.config_path.read_text()
        assert "    replicas: 2   # one for now" in text and text.startswith("# the operator's notes stay")
        fleet.wait_workers({"tiny-0", "tiny-1"})
        # a later edit of something else keeps both replicas
        fleet.write_config(textwrap.dedent(text).replace("drain_grace_s: 5", "drain_grace_s: 6"))
        wait_until(lambda: fleet.fleet()["applied_at"] is not None, 10, what="the edit applied")
        fleet.wait_workers({"tiny-0", "tiny-1"})
        assert [m["desired_replicas"] for m in fleet.fleet()["models"]] == [2]
    finally:
        fleet.proc.stop()
        fleet.kill_leftovers()
