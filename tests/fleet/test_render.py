"""`kvroute status` tables: the proxy's view and the fleet manager's are joined per worker."""

from __future__ import annotations

from rich.console import Console

from proxy.fleet.cmd_status import RateMeter
from proxy.fleet.render import fleet_tables, merge_rows

WORKERS = {
    "q-0": {"worker_id": "q-0", "state": "stale", "url": "http://10.0.0.5:8101", "models": ["q"], "dispatched_total": 10,
            "last_report": {"engine": "vllm", "kv_cache_usage": 0.42, "num_running": 3, "num_waiting": 1}},
    "lmdeploy-1": {"worker_id": "lmdeploy-1", "state": "ready", "url": "http://10.0.0.9:23333", "models": ["q"],
                   "engine": "turbomind", "in_flight": 2, "registered_at": 0.0},
}
FLEET = {"models": [{"name": "q", "desired_replicas": 2, "engine": "vllm", "placement": "local"}],
         "replicas": [
             {"worker_id": "q-0", "model": "q", "state": "ready", "engine": "vllm", "gpus": ["0", "1"],
              "started_at": 100.0, "restarts": 0},
             {"worker_id": "q-1", "model": "q", "state": "failed", "engine": "vllm", "gpus": ["2", "3"],
              "started_at": None, "restarts": 4, "last_error": "crash loop"}]}


def test_rows_join_registry_and_fleet_views():
    rows = {r["worker_id"]: r for r in merge_rows(WORKERS, FLEET)["q"]}
    assert rows["q-0"]["state"] == "stale"  # the proxy's finer state wins over the manager's "ready"
    assert rows["q-0"]["gpus"] == "0,1" and rows["q-0"]["kv"] == 0.42 and rows["q-0"]["waiting"] == 1
    assert rows["q-1"]["state"] == "failed" and rows["q-1"]["restarts"] == 4
    # A worker that registered by itself (not started by `kvroute up`) is listed too.
    assert rows["lmdeploy-1"]["engine"] == "turbomind" and rows["lmdeploy-1"]["running"] == 2


def test_table_shows_every_column_for_each_worker():
    console = Console(width=200, record=True)
    for t in fleet_tables(WORKERS, FLEET, {"q-0": 2.5}, now=160.0):
        console.print(t)
    text = console.export_text()
    assert "1/2 ready" in text  # q-0 is stale, q-1 failed, lmdeploy-1 ready
    for cell in ("q-0", "stale", "vllm", "10.0.0.5:8101", "0,1", "42%", "2.5", "1m00s", "q-1", "failed",
                 "lmdeploy-1", "turbomind"):
        assert cell in text, cell


def test_rate_meter_turns_counters_into_requests_per_second():
    meter = RateMeter()
    assert meter.update({"a": {"dispatched_total": 5}}) == {}
    meter._last["a"] = (meter._last["a"][0] - 2.0, 5)  # as if the first poll was 2 s ago
    assert round(meter.update({"a": {"dispatched_total": 15}})["a"]) == 5
