"""The one Prometheus text parser, checked sample for sample against prometheus_client's own parser."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.presets import get_preset
from backends.sim.scheduler import SimRequest
from backends.sim.server import SimServer
from backends.sim.tokens import chat_prompt
from proxy import promtext

# A vLLM server with two data-parallel ranks, in the shape vLLM 0.3x writes (process and gc series,
# histograms with +Inf buckets, `_created` series, an info metric with many labels), plus a label
# value holding a comma, a closing brace, an escaped quote, an escaped backslash and an escaped newline.
VLLM_DP_TEXT = r"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14302.0
python_gc_objects_collected_total{generation="1"} 2261.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76458711233e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct"} 7.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-VL-8B-Instruct"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-VL-8B-Instruct"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct",reason="capacity"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct"} 0.9
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-VL-8B-Instruct"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-VL-8B-Instruct"} 600.0
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct"} 1.7645871e+09
vllm:prefix_cache_queries_created{engine="1",model_name="Qwen/Qwen3-VL-8B-Instruct"} 1.7645871e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-VL-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-VL-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-VL-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-VL-8B-Instruct"} 3.25
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="a,b}c",waiting_lora_adapters="say \"hi\", C:\\x\nnext"} 1.7645871e+09
# a comment that is not HELP or TYPE
vllm:spec_decode_draft_acceptance_rate{engine="0"} NaN
vllm:spec_decode_efficiency{engine="0"} +Inf
vllm:spec_decode_slack{engine="0"} -Inf
vllm:timestamped{engine="0"} 3 1764587112330
"""

# LMDeploy 0.18's series (lmdeploy/metrics/loggers.py): no TYPE lines for some, the model in a label.
LMDEPLOY_TEXT = """\
# HELP lmdeploy:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE lmdeploy:gpu_cache_usage_perc gauge
lmdeploy:gpu_cache_usage_perc{model_name="qwen3-vl"} 0.6
lmdeploy:num_requests_running{model_name="qwen3-vl"} 4.0
lmdeploy:num_requests_waiting{model_name="qwen3-vl"} 2.0
lmdeploy:prefix_cache_hit_rate{model_name="qwen3-vl"} 0.35
# TYPE lmdeploy:time_to_first_token_seconds histogram
lmdeploy:time_to_first_token_seconds_bucket{le="0.5",model_name="qwen3-vl"} 100.0
lmdeploy:time_to_first_token_seconds_bucket{le="+Inf",model_name="qwen3-vl"} 110.0
lmdeploy:time_to_first_token_seconds_count{model_name="qwen3-vl"} 110.0
lmdeploy:time_to_first_token_seconds_sum{model_name="qwen3-vl"} 12.5
"""


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices("abcdefghij", k=5)) for _ in range(count))


def sim_metrics_text(served_name: str) -> str:
    """/metrics of a real sim engine (prometheus_client writes it) after a few requests ran to completion."""
    preset = get_preset("cpu-tiny").with_overrides(kv_capacity_tokens=2048, max_num_seqs=4,
                                                   frontend_s=0.0, frontend_s_per_prompt_token=0.0)
    server = SimServer(preset, served_name)
    engine = server.engine
    rng = random.Random(3)
    for i in range(6):
        prompt = chat_prompt([{"role": "user", "content": words(rng.randint(20, 120), seed=i % 3)}])
        engine.submit(SimRequest(f"r{i}", prompt, rng.randint(1, 40)))
    steps = 0
    while engine.scheduler.has_work() and steps < 10_000:
        for event in engine.scheduler.update(engine.scheduler.schedule(), now=float(steps)):
            if event.finished:
                server.metrics.observe_finished(event.request)
        steps += 1
    return server.metrics.render().decode()


def reference(text: str) -> list[tuple[str, dict[str, str], float | None, float | None]]:
    """prometheus_client's samples, NaN made comparable."""
    return [_comparable(s.name, s.labels, s.value, s.timestamp)
            for family in text_string_to_metric_families(text) for s in family.samples]


def ours(text: str, **filters) -> list[tuple[str, dict[str, str], float | None, float | None]]:
    metrics = promtext.parse(text, **filters)
    return [_comparable(s.name, s.labels, s.value, s.timestamp) for ss in metrics.by_name.values() for s in ss]


def _comparable(name, labels, value, timestamp):
    return name, dict(labels), None if math.isnan(value) else float(value), timestamp


def by_key(samples):
    return sorted(samples, key=lambda s: (s[0], sorted(s[1].items())))


@pytest.mark.parametrize("text", [VLLM_DP_TEXT, LMDEPLOY_TEXT], ids=["vllm-data-parallel", "lmdeploy"])
def test_every_sample_matches_prometheus_clients_parser(text):
    assert by_key(ours(text)) == by_key(reference(text))


def test_a_sim_workers_metrics_with_a_hostile_model_name_match_prometheus_clients_parser():
    name = 'tenant,a}"quoted"\\back\nslash'
    text = sim_metrics_text(name)
    assert '\\"quoted\\"' in text and "\\n" in text  # prometheus_client escaped it on the way out
    mine = ours(text)
    assert by_key(mine) == by_key(reference(text))
    assert any(s[0].endswith("_created") for s in mine) and any(s[1].get("le") == "+Inf" for s in mine)
    assert {s[1]["model_name"] for s in mine if "model_name" in s[1]} == {name}


def test_label_values_keep_commas_braces_and_escapes():
    metrics = promtext.parse(VLLM_DP_TEXT)
    [lora] = metrics.samples("vllm:lora_requests_info")
    assert lora.labels == {"max_lora": "1", "running_lora_adapters": "a,b}c",
                           "waiting_lora_adapters": 'say "hi", C:\\x\nnext'}


def test_non_finite_values_and_timestamps_are_read():
    metrics = promtext.parse(VLLM_DP_TEXT)
    assert math.isnan(metrics.samples("vllm:spec_decode_draft_acceptance_rate")[0].value)
    assert metrics.samples("vllm:spec_decode_efficiency")[0].value == math.inf
    assert metrics.samples("vllm:spec_decode_slack")[0].value == -math.inf
    assert metrics.samples("vllm:timestamped")[0].timestamp == pytest.approx(1764587112.33)
    # ...but a reduction leaves out what says nothing about load
    assert metrics.total("vllm:spec_decode_draft_acceptance_rate") is None


def test_a_name_filter_reads_only_those_series_and_not_longer_names_sharing_the_prefix():
    wanted = ["vllm:num_requests_waiting", "vllm:prefix_cache_queries_total"]
    metrics = promtext.parse(VLLM_DP_TEXT, names=wanted)
    assert sorted(metrics.by_name) == sorted(wanted)  # not _waiting_by_reason, not _created
    assert by_key(ours(VLLM_DP_TEXT, names=wanted)) == by_key(s for s in reference(VLLM_DP_TEXT) if s[0] in wanted)
    assert sorted(promtext.parse(LMDEPLOY_TEXT, prefixes=["lmdeploy:time_to_first"]).by_name) == [
        "lmdeploy:time_to_first_token_seconds_bucket", "lmdeploy:time_to_first_token_seconds_count",
        "lmdeploy:time_to_first_token_seconds_sum"]


def test_reductions_over_label_sets_and_label_filters():
    metrics = promtext.parse(VLLM_DP_TEXT)
    assert metrics.total("vllm:num_requests_running") == 12
    assert metrics.total("vllm:num_requests_running", where={"engine": "1"}) == 5
    assert metrics.maximum("vllm:num_requests_waiting") == 3
    assert metrics.mean("vllm:prefix_cache_queries_total") == 800
    assert metrics.total("vllm:time_to_first_token_seconds_bucket", where={"le": "+Inf"}) == 20
    assert metrics.total("no_such_series") is None
    assert metrics.totals()["vllm:prefix_cache_queries_total"] == 1600


def test_kv_usage_of_data_parallel_ranks_is_their_mean_and_capacity_their_sum():
    metrics = promtext.parse(VLLM_DP_TEXT)
    assert promtext.kv_usage(metrics, ["vllm:kv_cache_usage_perc"]) == pytest.approx(0.7)
    assert promtext.kv_capacity_tokens(metrics, "vllm:cache_config_info") == 2 * 2048 * 16
    # used tokens agree: 0.9 * 32768 + 0.5 * 32768 == 0.7 * 65536
    assert promtext.kv_usage(promtext.parse("x 85\n"), ["x"]) == pytest.approx(0.85)  # a true percent
    assert promtext.kv_usage(metrics, ["lmdeploy:gpu_cache_usage_perc"]) is None


@pytest.mark.parametrize("line", [
    "foo-1 2",                       # not a name followed by a blank
    'foo{a="1" 2',                   # unclosed labels
    'foo{a=1} 2',                    # unquoted value
    'foo{a="x} 2',                   # unclosed quote
    "foo",                           # no value
    "foo 1 2 3",                     # too many fields
    "foo 1_000",                     # Go's parser takes no digit separators
    "foo abc",
])
def test_a_malformed_line_is_skipped_and_the_rest_still_read(line):
    metrics = promtext.parse(f"{line}\nvllm:num_requests_running 4\n")
    assert list(metrics.by_name) == ["vllm:num_requests_running"]


def test_blank_padding_trailing_commas_and_empty_braces_are_accepted():
    text = '  a{x="1",} 1\nb{} 2\nc { y = "2" } 3\n'
    assert by_key(ours(text)) == by_key(reference(text))


def test_the_proxys_scrape_and_the_workers_report_read_a_data_parallel_engine_alike():
    from backends.engines.vllm import VllmAdapter
    from proxy.workers.engine_metrics import parse_engine_metrics

    scraped = parse_engine_metrics(VLLM_DP_TEXT)
    reported = VllmAdapter().load_from_metrics(VLLM_DP_TEXT)
    assert scraped is not None
    assert scraped.kv_usage == reported.kv_cache_usage == pytest.approx(0.7)
    assert scraped.capacity_tokens == reported.kv_capacity_tokens == 65536
    assert (scraped.num_running, scraped.num_waiting) == (reported.num_running, reported.num_waiting) == (12, 3)
