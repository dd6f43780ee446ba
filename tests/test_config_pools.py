"""models[].pools, kv_transfer and ec_transfer: what a disaggregated model may say, and the errors (key path and
line) for what cannot run."""

from __future__ import annotations

import textwrap

import pytest

from proxy.config import ConfigError, parse_config


def parse(text: str):
    return parse_config(textwrap.dedent(text), source="fleet.yaml", env={})


def problems_of(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse(text)
    return str(err.value)


VLLM_PD = """\
    models:
      - name: q
        engine: vllm
        model: /models/q
        gpus_per_replica: 1
        engine_args: {max-model-len: 8192}
        pools:
          - {role: prefill, replicas: 2, engine_args: {max-num-batched-tokens: 16384}}
          - {role: decode, replicas: 6}
    """


def with_key(line: str, text: str = VLLM_PD) -> str:
    """VLLM_PD with one more key of the model, just above `pools:`."""
    return text.replace("        pools:", f"        {line}\n        pools:")


def test_pools_by_role_with_nixl_by_default_on_gpus():
    m = parse(VLLM_PD).models[0]
    assert [(p.role, p.replicas) for p in m.pool_list()] == [("prefill", 2), ("decode", 6)]
    assert m.kv_transfer is None  # the fleet gives it NIXL's defaults (proxy/fleet/launcher.py)


def test_replicas_alone_is_one_pool_of_role_both():
    m = parse("models:\n  - {name: s, engine: sim, replicas: 3}\n").models[0]
    assert [(p.role, p.replicas) for p in m.pool_list()] == [("both", 3)]


@pytest.mark.parametrize(("pools", "error"), [
    ("[{role: prefill}]", "a prefill pool needs a decode (or both) pool"),
    ("[{role: decode}, {role: both}]", "a decode pool needs a prefill pool"),
    ("[{role: encode}]", "an encode pool needs a pool that generates"),
    ("[{role: prefill}, {role: decode}, {role: decode, replicas: 2}]", "one pool per role: role decode appears 2"),
])
def test_pool_combinations_that_cannot_serve_name_the_pools_line(pools, error):
    msg = problems_of(f"""\
        models:
          - name: s
            engine: sim
            pools: {pools}
        """)
    assert f"models[0].pools (line 4): {error}" in msg


def test_replicas_and_pools_together_are_refused():
    msg = problems_of("""\
        models:
          - name: s
            engine: sim
            replicas: 2
            pools:
              - {role: both}
        """)
    assert "models[0].pools (line 6): give either replicas or pools, not both" in msg


def test_unknown_key_in_a_pool_and_an_unknown_role_and_link_are_refused():
    msg = problems_of("""\
        models:
          - name: s
            engine: sim
            kv_transfer: {link: carrier-pigeon}
            pools:
              - {role: prefill, replicas: 1, colour: red}
              - {role: decoder}
        """)
    assert "models[0].pools[0].colour (line 6): unknown key" in msg
    assert "models[0].pools[1].role (line 7): Input should be 'both', 'prefill', 'decode' or 'encode'" in msg
    assert "models[0].kv_transfer.link (line 4)" in msg


def test_cpu_vllm_must_name_a_connector_and_example_connector_needs_its_folder():
    cpu = VLLM_PD.replace("gpus_per_replica: 1", "device: cpu")
    assert "device cpu: name kv_transfer.connector" in problems_of(cpu)
    shared = with_key("kv_transfer: {connector: ExampleConnector}", cpu)
    assert "models[0].kv_transfer (line 7): ExampleConnector keeps KV in files" in problems_of(shared)
    ok = with_key("kv_transfer: {connector: ExampleConnector, extra: {shared_storage_path: /kv}}", cpu)
    assert parse(ok).models[0].kv_transfer.kv_role("prefill") == "kv_producer"


def test_engines_without_roles_and_encoders_without_their_connector_are_refused():
    turbomind = VLLM_PD.replace("engine: vllm", "engine: turbomind")
    assert "roles other than both need engine vllm or sim, not turbomind" in problems_of(turbomind)
    encode = VLLM_PD.replace("{role: decode, replicas: 6}", "{role: decode, replicas: 6}\n          - {role: encode}")
    assert "ECExampleConnector keeps encoder output in files" in problems_of(encode)
    stray = with_key("ec_transfer: {connector: ECExampleConnector}")
    assert "models[0].ec_transfer (line 7): ec_transfer is set but there is no encode pool" in problems_of(stray)


def test_a_pools_env_follows_the_models_env_rules():
    msg = problems_of(VLLM_PD.replace("{role: decode, replicas: 6}", "{role: decode, env: {LD_PRELOAD: /x.so}}"))
    assert "models[0].pools[1].env" in msg and "refused: LD_PRELOAD" in msg


def test_the_prefill_pool_produces_and_the_decode_pool_consumes_unless_the_operator_says_otherwise():
    m = parse(with_key("kv_transfer: {kv_roles: {decode: kv_both}}")).models[0]
    assert m.kv_transfer.connector_for("cuda") == "NixlConnector"  # vLLM 0.32 deprecates kv_both on NIXL's P and D
    assert (m.kv_transfer.kv_role("prefill"), m.kv_transfer.kv_role("decode"), m.kv_transfer.kv_role("both")) == \
        ("kv_producer", "kv_both", "kv_both")
