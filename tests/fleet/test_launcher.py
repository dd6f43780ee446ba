"""The `kvroute worker` command line a replica gets, and when a config change restarts it."""

from __future__ import annotations

import json

from proxy.cli import build_parser
from proxy.config import ModelConfig
from proxy.fleet.launcher import WorkerLaunch, pools_of, spec_fingerprint, worker_id_for


def parse(argv: list[str]):
    assert argv[1:3] == ["-m", "proxy.cli"]
    return build_parser().parse_args(argv[3:])


def test_vllm_replica_gets_its_gpus_model_and_engine_args_after_the_separator():
    m = ModelConfig(name="Qwen/Qwen3-VL-8B", engine="vllm", model="/models/q", gpus_per_replica=2,
                    engine_args={"max-model-len": 8192, "enforce-eager": True}, env={"HF_HOME": "/hf"})
    launch = WorkerLaunch(worker_id=worker_id_for(m.name, 3, 0), model=m, proxy_url="http://p:8000",
                          gpus=["2", "3"], drain_grace_s=15, worker_token="tok")
    args = parse(launch.argv("127.0.0.1", 8101, advertise_url="http://127.0.0.1:8101"))
    assert (args.engine, args.port, args.gpus, args.model, args.device) == ("vllm", 8101, "2,3", "/models/q", "cuda")
    assert args.worker_id == "Qwen-Qwen3-VL-8B-3" and args.served_model_name == "Qwen/Qwen3-VL-8B"
    assert args.drain_grace_s == 15 and args.proxy_url == "http://p:8000"
    assert args.engine_args == ["--", "--max-model-len", "8192", "--enforce-eager"]
    env = launch.env()
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["HF_HOME"] == "/hf"
    assert env["KVROUTE_WORKER_TOKEN"] == "tok" and "tok" not in " ".join(launch.argv("h", 1))


def test_sim_options_are_worker_flags_and_a_cpu_replica_sees_no_gpu():
    m = ModelConfig(name="tiny", engine="sim", preset="cpu-tiny", device="cpu",
                    engine_args={"time-scale": 5, "max-num-seqs": 8})
    launch = WorkerLaunch(worker_id="tiny-0", model=m, proxy_url="http://p", gpus=[])
    args = parse(launch.argv("127.0.0.1", 9000))
    assert (args.preset, args.time_scale, args.max_num_seqs, args.engine_args) == ("cpu-tiny", 5.0, 8, [])
    assert launch.env()["CUDA_VISIBLE_DEVICES"] == ""


def test_only_worker_side_changes_restart_replicas():
    base = ModelConfig(name="q", engine="sim", replicas=2, engine_args={"time-scale": 1})
    assert spec_fingerprint(base) == spec_fingerprint(base.model_copy(update={"replicas": 5, "aliases": ["x"]}))
    for change in ({"engine_args": {"time-scale": 2}}, {"env": {"VLLM_A": "1"}}, {"preset": "h100-qwen3-vl-8b"},
                   {"gpus_per_replica": 1}):
        assert spec_fingerprint(base) != spec_fingerprint(base.model_copy(update=change)), change


def pd_model(**changes) -> ModelConfig:
    data = {"name": "q", "engine": "vllm", "model": "/models/q", "gpus_per_replica": 1,
            "engine_args": {"max-model-len": 8192}, "env": {"HF_HOME": "/hf"},
            "pools": [{"role": "prefill", "replicas": 2, "engine_args": {"max-num-batched-tokens": 16384},
                       "env": {"VLLM_X": "p"}},
                      {"role": "decode", "replicas": 6, "gpus_per_replica": 2}]}
    return ModelConfig.model_validate({**data, **changes})


def test_each_pool_runs_its_role_with_its_flags_merged_over_the_models():
    prefill, decode = pools_of(pd_model())
    assert (prefill.role, prefill.replicas, decode.role, decode.replicas) == ("prefill", 2, "decode", 6)
    assert prefill.model.engine_args == {"max-model-len": 8192, "max-num-batched-tokens": 16384}
    assert prefill.model.env == {"HF_HOME": "/hf", "VLLM_X": "p"}
    assert (prefill.model.gpus_per_replica, decode.model.gpus_per_replica) == (1, 2)
    assert (prefill.label, worker_id_for("q", 1, 0, "prefill")) == ("q/prefill", "q-prefill-1")
    launch = WorkerLaunch(worker_id="q-prefill-1", model=prefill.model, proxy_url="http://p", gpus=["0"],
                          role="prefill")
    args = parse(launch.argv("127.0.0.1", 8101))
    assert args.role == "prefill"
    assert json.loads(args.kv_transfer) == {"connector": "NixlConnector", "kv_role": "kv_producer", "extra": {},
                                            "options": {}, "link": "rdma-400g"}
    assert args.engine_args == ["--", "--max-model-len", "8192", "--max-num-batched-tokens", "16384"]


def test_an_aggregated_model_keeps_its_ids_flags_and_fingerprint_shape():
    (only,) = pools_of(ModelConfig(name="tiny", engine="sim", replicas=3))
    assert (only.role, only.replicas, only.label, only.model.kv_transfer) == ("both", 3, "tiny", None)
    args = parse(WorkerLaunch(worker_id="tiny-0", model=only.model, proxy_url="http://p").argv("h", 1))
    assert (args.role, args.kv_transfer) == ("both", None)


def test_a_pools_change_restarts_that_pool_only_and_its_count_restarts_nothing():
    before = {p.role: spec_fingerprint(p.model, p.role) for p in pools_of(pd_model())}
    recount = pd_model(pools=[{"role": "prefill", "replicas": 5, "engine_args": {"max-num-batched-tokens": 16384},
                               "env": {"VLLM_X": "p"}}, {"role": "decode", "replicas": 1, "gpus_per_replica": 2}])
    assert {p.role: spec_fingerprint(p.model, p.role) for p in pools_of(recount)} == before
    retuned = pd_model(pools=[{"role": "prefill", "replicas": 2, "engine_args": {"max-num-batched-tokens": 8192},
                               "env": {"VLLM_X": "p"}}, {"role": "decode", "replicas": 6, "gpus_per_replica": 2}])
    after = {p.role: spec_fingerprint(p.model, p.role) for p in pools_of(retuned)}
    assert after["decode"] == before["decode"] and after["prefill"] != before["prefill"]
    relinked = {p.role: spec_fingerprint(p.model, p.role) for p in pools_of(pd_model(kv_transfer={"link": "nvlink"}))}
    assert all(relinked[role] != before[role] for role in before)  # the connector is every pool's
