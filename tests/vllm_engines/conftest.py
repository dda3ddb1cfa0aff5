"""Fixtures for the real-vLLM engine tests: the vLLM venv's python, a log directory and a
tiny random-weight Llama. A missing vLLM venv fails these tests with the fix in the message
(``hack/vllm-venv.sh ensure``); it never skips them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_testkit.vllm_harness import vllm_python, write_model


@pytest.fixture(scope="session")
def vllm_py() -> str:
    """The vLLM venv's python (fails the test, with the fix, when there is none)."""
    try:
        return vllm_python()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per-module directory for the engines' stderr logs (kept by pytest's tmp retention)."""
    return tmp_path_factory.mktemp("vllm-engines")


@pytest.fixture(scope="module")
def llama_model(vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with seeded random float32 weights (one KV cache group)."""
    return write_model(tmp_path_factory.mktemp("llama") / "model", kind="llama", seed=1)


@pytest.fixture(scope="module")
def hybrid_model(vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Llama alternating sliding-window (64) and full attention: two KV cache
    groups, layers 0+2 and 1+3, each pair sharing one KV tensor."""
    return write_model(tmp_path_factory.mktemp("hybrid") / "model", kind="hybrid", seed=1)
