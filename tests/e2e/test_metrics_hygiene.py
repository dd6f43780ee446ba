"""Metric label sets of removed workers go with them: /metrics stays the same size however many worker
ids come and go (ids churn with every restart generation)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(180)


def test_metrics_size_is_flat_across_100_register_serve_remove_cycles(fleet):
    fleet.start_proxy()
    (sim,) = fleet.start_sims(1, register=False)

    def cycle(i: int) -> None:
        worker_id = f"gen-{i}"
        fleet.register(worker_id, sim.url)
        resp = fleet.chat(f"q{i}")
        assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == worker_id
        assert fleet.http.delete(f"{fleet.url}/workers/{worker_id}", headers=fleet.admin()).status_code == 200

    for i in range(10):
        cycle(i)
    after_10 = fleet.http.get(fleet.url + "/metrics").text
    for i in range(10, 100):
        cycle(i)
    after_100 = fleet.http.get(fleet.url + "/metrics").text

    assert 'worker="gen-' not in after_100
    # the same series: only counter values and timestamps may have grown a digit
    assert _series(after_100) == _series(after_10)
    assert len(after_100) - len(after_10) < 1000


def _series(text: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
