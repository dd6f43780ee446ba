"""config.yaml errors name the key path and the line, and `${VAR}` interpolation works as documented."""

from __future__ import annotations

import textwrap

import pytest

from proxy.config import ConfigError, load_config, parse_config


def problems_of(text: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(textwrap.dedent(text), source="fleet.yaml", env=env or {})
    return str(err.value)


def test_negative_replicas_names_path_and_line():
    msg = problems_of("""\
        models:
          - name: a
            engine: sim
          - name: b
            engine: sim
            replicas: -1
        """)
    assert "models[1].replicas (line 6): must be >= 0" in msg
    assert msg.startswith("fleet.yaml")


def test_unknown_key_is_an_error_with_its_line():
    msg = problems_of("""\
        proxy:
          port: 8000
          polcy: kv_aware
        """)
    assert "proxy.polcy (line 3): unknown key" in msg


def test_unknown_engine_lists_the_choices():
    msg = problems_of("""\
        models:
          - name: a
            engine: tensorrt
        """)
    assert "models[0].engine (line 3)" in msg and "'vllm'" in msg and "'sim'" in msg


def test_every_problem_is_reported_at_once():
    msg = problems_of("""\
        proxy:
          port: 70000
        models:
          - name: a
            engine: sim
            gpus_per_replica: -2
        """)
    assert "proxy.port (line 2): must be <= 65535" in msg
    assert "models[0].gpus_per_replica (line 6): must be >= 0" in msg


def test_vllm_without_a_checkpoint_is_refused_at_the_model():
    msg = problems_of("""\
        models:
          - name: qwen
            engine: vllm
            device: cpu
        """)
    assert "models[0] (line 2): engine vllm needs 'model'" in msg


def test_gpu_engine_needs_gpus():
    msg = problems_of("""\
        models:
          - name: qwen
            engine: vllm
            model: /models/qwen
        """)
    assert "models[0] (line 2): device cuda needs gpus_per_replica >= 1" in msg


def test_duplicate_model_name_or_alias_is_refused():
    msg = problems_of("""\
        models:
          - {name: a, engine: sim, aliases: [x]}
          - {name: b, engine: sim, aliases: [x]}
        """)
    assert "'x' is used by both a and b" in msg


def test_duplicate_key_is_refused_with_its_line():
    msg = problems_of("""\
        models:
          - name: a
            engine: sim
            replicas: 1
            replicas: 2
        """)
    assert "models[0].replicas (line 5): duplicate key" in msg


def test_invalid_yaml_names_the_line():
    msg = problems_of("""\
        models:
          - name: a
            engine: [sim
        """)
    assert "line" in msg and "invalid YAML" in msg


def test_missing_variable_without_default_names_path_and_line():
    msg = problems_of("""\
        proxy:
          admin_token: ${ADMIN_TOKEN}
        """)
    assert "proxy.admin_token (line 2): environment variable ADMIN_TOKEN is not set" in msg


def test_interpolation_with_defaults_and_types():
    cfg = parse_config(textwrap.dedent("""\
        proxy:
          port: ${PORT:-8123}
          admin_token: "${TOKEN}"
        models:
          - name: ${NAME:-qwen}
            engine: sim
            replicas: ${REPLICAS:-2}
        """), env={"TOKEN": "s3cret", "REPLICAS": "5"})
    assert cfg.proxy.port == 8123
    assert cfg.proxy.admin_token == "s3cret"
    assert cfg.models[0].name == "qwen" and cfg.models[0].replicas == 5


def test_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_engine_args_become_flags():
    cfg = parse_config(textwrap.dedent("""\
        models:
          - name: q
            engine: vllm
            device: cpu
            model: /m
            engine_args: {max-num-seqs: 8, enforce_eager: true, disable-log-stats: false, limit-mm: [1, 2]}
        """), env={})
    assert cfg.models[0].engine_arg_list() == ["--max-num-seqs", "8", "--enforce-eager", "--limit-mm", "1", "2"]
