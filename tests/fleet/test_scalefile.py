"""`kvroute scale` writes the count back into the config file and leaves every other byte alone."""

from __future__ import annotations

import os

import pytest

from proxy.config import parse_config
from proxy.fleet.scalefile import ScaleWriteError, set_replicas, write_replicas

CONFIG = """\
# our fleet (comments stay)
proxy:
  port: 8000   # the public port
models:
  - name: small
    engine: sim
    replicas: 2        # two is plenty at night
    engine_args: {time-scale: 1}
  - name: "big"
    aliases: [large]
    engine: sim
"""


def test_the_count_changes_and_comments_and_other_models_stay():
    out = set_replicas(CONFIG, "small", 5)
    assert out == CONFIG.replace("replicas: 2        #", "replicas: 5        #")
    assert [m.replicas for m in parse_config(out).models] == [5, 1]


def test_a_model_without_replicas_gets_the_line_after_its_name():
    out = set_replicas(CONFIG, "big", 3)
    assert '  - name: "big"\n    replicas: 3\n    aliases: [large]\n' in out
    assert [m.replicas for m in parse_config(out).models] == [2, 3]


def test_an_unknown_model_or_a_flow_style_entry_is_refused():
    with pytest.raises(ScaleWriteError, match="no model named"):
        set_replicas(CONFIG, "nope", 1)
    with pytest.raises(ScaleWriteError, match="flow style"):
        set_replicas("models:\n  - {name: a, engine: sim}\n", "a", 2)
    with pytest.raises(ScaleWriteError, match="comes from"):
        set_replicas("models:\n  - name: a\n    replicas: ${A_REPLICAS:-1}\n", "a", 2)


def test_write_replicas_keeps_the_file_mode(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(CONFIG)
    path.chmod(0o640)
    write_replicas(path, "small", 0)
    assert "replicas: 0        # two is plenty" in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["fleet.yaml"]


POOLS = """\
models:
  - name: q   # disaggregated
    engine: sim
    pools:
      - {role: prefill}
      - role: decode
        replicas: 3   # three at night
      - role: encode
        preset: cpu-tiny
"""


def test_a_pools_count_is_written_in_that_pool_whatever_its_style():
    assert set_replicas(POOLS, "q", 5, "decode") == POOLS.replace("replicas: 3   #", "replicas: 5   #")
    assert "- {role: prefill, replicas: 2}" in set_replicas(POOLS, "q", 2, "prefill")
    added = set_replicas(POOLS, "q", 4, "encode")
    assert "      - role: encode\n        replicas: 4\n        preset: cpu-tiny" in added
    assert [(p.role, p.replicas) for p in parse_config(added).models[0].pools] == [
        ("prefill", 1), ("decode", 3), ("encode", 4)]
    for role in (None, "both"):
        with pytest.raises(ScaleWriteError):
            set_replicas(POOLS, "q", 2, role)


async def test_an_edit_back_to_the_text_before_a_scale_is_applied_even_within_one_poll(tmp_path):
    """`kvroute scale` writes 3 into the file; an operator puts 2 back before the watcher's next look. The file's text
    is then the text the watcher saw first, but the fleet runs 3: the edit must be applied, not read as no change."""
    from proxy.fleet.config_watch import ConfigWatcher

    path = tmp_path / "fleet.yaml"
    path.write_text(CONFIG)
    applied: list[list[int]] = []
    watcher = ConfigWatcher(path, lambda config: applied.append([m.replicas for m in config.models]),
                            initial_text=CONFIG)
    assert not await watcher.check()  # the file as it started: nothing to do
    write_replicas(path, "small", 3)  # what /fleet/scale does after scaling the fleet itself...
    watcher.file_rewritten()  # ...and tells the watcher
    path.write_text(CONFIG)  # the edit back, before any poll saw the 3
    assert await watcher.check() and applied == [[2, 1]]
    assert not await watcher.check()  # and once only
    os.utime(path)  # a touch is no edit
    assert not await watcher.check() and applied == [[2, 1]]


async def test_an_edit_just_before_a_scale_is_kept_by_the_rewrite_and_applied(tmp_path):
    from proxy.fleet.config_watch import ConfigWatcher

    path = tmp_path / "fleet.yaml"
    path.write_text(CONFIG)
    applied: list[list[int]] = []
    watcher = ConfigWatcher(path, lambda config: applied.append([m.replicas for m in config.models]),
                            initial_text=CONFIG)
    assert not await watcher.check()
    path.write_text(CONFIG.replace('name: "big"', 'name: "big"\n    replicas: 4'))  # the operator's edit...
    write_replicas(path, "small", 3)  # ...then a scale, before any poll
    watcher.file_rewritten()
    assert await watcher.check() and applied == [[3, 4]]
