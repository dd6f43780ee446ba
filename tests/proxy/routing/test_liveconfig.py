"""Which proxy keys a running proxy takes from a new config (proxy/routing/live_changes.py)."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, parse_config
from proxy.routing.live_changes import merge

RUNNING = parse_config("proxy:\n  port: 9000\n  admin_token: generated\n  retries: 2\nmodels: []\n")


def test_live_keys_change_and_the_others_are_named_but_kept():
    new = parse_config("proxy:\n  retries: 5\n  timeouts: {total_s: 60}\n  max_body_bytes: 2048\n"
                       "state: redis://127.0.0.1:6379/0\nmodels:\n  - {name: m, engine: sim, aliases: [a]}\n")
    change = merge(RUNNING, new)
    assert change.live == ["proxy.retries", "proxy.timeouts"]
    assert change.restart == ["proxy.max_body_bytes", "state"]
    proxy = change.config.proxy
    assert (proxy.retries, proxy.timeouts.total_s) == (5, 60)
    assert (proxy.max_body_bytes, proxy.port, proxy.admin_token) == (RUNNING.proxy.max_body_bytes, 9000, "generated")
    assert change.config.state == RUNNING.state and change.config.model("a").name == "m"
    assert "NOT applied" in (change.describe() or "") and "proxy.max_body_bytes" in change.describe()


def test_keys_the_file_does_not_set_are_not_reported_and_an_unchanged_file_reports_nothing():
    assert merge(RUNNING, parse_config("models: []\n")).restart == []
    assert merge(RUNNING, RUNNING).describe() is None


def test_an_unknown_policy_is_refused_with_its_key_path():
    with pytest.raises(ConfigError, match=r"models\[0\].policy: unknown routing policy 'nope'"):
        merge(RUNNING, parse_config("models:\n  - {name: m, engine: sim, policy: nope}\n"))


def test_routing_knobs_change_live_globally_and_per_model():
    running = parse_config("models:\n  - {name: m, engine: sim}\n  - {name: n, engine: sim}\n")
    new = parse_config("proxy:\n  routing:\n    admission: {admit_after_output: false}\n"
                       "models:\n  - {name: m, engine: sim, routing: {kv_aware: {prefix_weight: 0.5}}}\n"
                       "  - {name: n, engine: sim}\n  - {name: o, engine: sim, routing: {prefix: {min_match_fraction: 0.5}}}\n")
    change = merge(running, new)
    assert change.live == ["proxy.routing", "models[0].routing"] and change.restart == []
    assert change.config.proxy.routing.admission.admit_after_output is False
    assert change.config.model("m").routing.kv_aware.prefix_weight == 0.5


def test_the_media_url_policy_changes_live():
    new = parse_config("proxy:\n  media_urls: {allowed_networks: [10.20.0.0/16]}\nmodels: []\n")
    change = merge(RUNNING, new)
    assert change.live == ["proxy.media_urls"] and change.restart == []
    assert change.config.proxy.media_urls.allowed_networks == ["10.20.0.0/16"]
    with pytest.raises(ConfigError, match="not a CIDR network"):
        parse_config("proxy:\n  media_urls: {allowed_networks: [intranet]}\nmodels: []\n")
