"""A reporting worker whose reports stopped is forgotten only when it also fails its /health probe: its
proxy may have died (replicas), and a live worker must never be dropped for that."""

from __future__ import annotations

from proxy.workers.monitor import FORGET_SILENT_AFTER_S, HealthMonitor
from proxy.workers.registry import Worker


def _silent_worker(probe_failed: bool) -> Worker:
    worker = Worker("w", "http://127.0.0.1:9", ["m1"], now=0.0)
    worker.probe_failed = probe_failed
    return worker


def test_a_silent_worker_that_answers_its_probe_is_kept_and_one_that_does_not_is_forgotten():
    later = FORGET_SILENT_AFTER_S + 1
    assert not HealthMonitor._long_silent(_silent_worker(probe_failed=False), later)
    assert HealthMonitor._long_silent(_silent_worker(probe_failed=True), later)
    assert not HealthMonitor._long_silent(_silent_worker(probe_failed=True), FORGET_SILENT_AFTER_S - 1)


def test_proxy_urls_parse_from_repeats_and_commas():
    from backends.reporter import parse_proxy_urls

    assert parse_proxy_urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    assert parse_proxy_urls(["http://a:1", "http://b:2,http://a:1"]) == ["http://a:1", "http://b:2"]
    assert parse_proxy_urls(None) == [] and parse_proxy_urls("") == []
