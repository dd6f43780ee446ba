"""deploy/grafana/kvroute.json asks only for metrics that exist, and docs/observability.md documents every kvroute: metric.

The kvroute: side is checked against the /metrics of a real running proxy (`kvroute up` with one sim
worker, after one request). The vllm: side is checked against tests/data/vllm_metrics.txt: the /metrics
text of a real vLLM CPU worker, captured once (starting vLLM takes 30-70 s and ~3 GB, too slow for every
run) by `python -m tests.observability.capture_vllm_metrics`; run that again when the vLLM version changes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import REPO, ProcessGroup, free_port, wait_http_ok, wait_until

BOARD = REPO / "deploy" / "grafana" / "kvroute.json"
VLLM_METRICS = REPO / "tests" / "data" / "vllm_metrics.txt"
METRIC_NAME = re.compile(r"\b(?:kvroute|vllm):[A-Za-z0-9_:]+")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",), "unknown": ("",)}


def exposed_names(text: str) -> dict[str, str]:
    """{every series name a scrape of `text` can hold: its family}: samples, and what a family's type implies
    (a labelled family with no child yet still declares its type)."""
    names: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = family.name
        for sample in family.samples:
            names[sample.name] = family.name
    return names


def board_queries() -> list[str]:
    board = json.loads(BOARD.read_text())
    exprs = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(board["panels"])
    for var in board.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query.get("query", ""))
        elif isinstance(query, str) and var.get("type") == "query":
            exprs.append(query)
    return exprs


def proxy_metrics_text(procs: ProcessGroup, tmp_path: Path) -> str:
    config = tmp_path / "fleet.yaml"
    config.write_text("proxy:\n  host: 127.0.0.1\nmodels:\n  - name: tiny\n    engine: sim\n    preset: cpu-tiny\n"
                      "    device: cpu\n    replicas: 1\n    engine_args: {time-scale: 10}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs.kvroute("up", str(config), "--port", str(port), "--run-dir", str(tmp_path / "logs"), name="up")
    wait_http_ok(url + "/ready", timeout=90)
    # One request, so the labelled request, latency and TTFT series have a child each.
    resp = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    return wait_until(lambda: (lambda t: t if "kvroute:requests_total{" in t else None)(
        httpx.get(url + "/metrics", timeout=5).text), 10, 0.1, "the request in /metrics")


def test_every_grafana_query_names_metrics_that_real_metrics_output_has(procs, tmp_path):
    proxy = exposed_names(proxy_metrics_text(procs, tmp_path))
    vllm = exposed_names(VLLM_METRICS.read_text())
    assert "vllm:kv_cache_usage_perc" in vllm, "tests/data/vllm_metrics.txt is not a vLLM /metrics capture"
    queries = board_queries()
    assert len(queries) >= 20
    used = {name for q in queries for name in METRIC_NAME.findall(q)}
    assert {n for n in used if n.startswith("kvroute:")} and {n for n in used if n.startswith("vllm:")}
    missing = sorted(n for n in used if n not in (proxy if n.startswith("kvroute:") else vllm))
    assert missing == [], f"the board queries metrics that no real /metrics has: {missing}"

    # docs/observability.md's Metrics section names every kvroute: family the proxy exposes.
    manual = (REPO / "docs" / "observability.md").read_text()
    section = manual.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    undocumented = sorted({family for family in proxy.values() if family.startswith("kvroute:")
                           and not family.endswith("_created")  # a counter's creation time, documented once
                           and f"`{family}" not in section})
    assert undocumented == [], f"docs/observability.md's Metrics section misses {undocumented}"
