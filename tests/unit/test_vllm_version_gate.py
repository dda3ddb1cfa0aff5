"""The connector's vLLM release gate, without vLLM: tested releases load, others are refused
naming both the running and the tested releases, unless the user opts in (then a warning)."""

from __future__ import annotations

import logging

import pytest

from kvbridge_agent.errors import KVBridgeError
from kvbridge_agent.vllm._version_gate import (
    ALLOW_UNTESTED_KEY,
    TESTED_VLLM_VERSIONS,
    UntestedVllmError,
    check_vllm_version,
)


def test_the_tested_release_is_0_30_0() -> None:
    assert TESTED_VLLM_VERSIONS == ("0.30.0",)
    assert ALLOW_UNTESTED_KEY == "kvbridge_allow_untested_vllm"


@pytest.mark.parametrize("version", ["0.30.0", "0.30.0+cu128", " 0.30.0 "])
def test_tested_release_loads_silently(version: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert check_vllm_version(version) is None
        assert check_vllm_version(version, {ALLOW_UNTESTED_KEY: True}) is None
    assert caplog.records == []


@pytest.mark.parametrize("version", ["0.31.0", "0.29.2", "0.30.1.dev12+g1234abc", "0.30.0rc1",
                                     "0.30"])
def test_untested_release_is_refused_naming_both(version: str) -> None:
    with pytest.raises(UntestedVllmError) as err:
        check_vllm_version(version, {})
    text = str(err.value)
    assert text.startswith(f"vLLM {version} is not a release kvbridge's KVBridgeConnector was "
                           "tested with (tested: 0.30.0); refusing to load")
    assert f'"{ALLOW_UNTESTED_KEY}": true' in text
    assert isinstance(err.value, KVBridgeError) and isinstance(err.value, RuntimeError)


@pytest.mark.parametrize("flag", [False, "false", "False"])
def test_an_explicit_no_still_refuses(flag: object) -> None:
    with pytest.raises(UntestedVllmError, match="refusing to load"):
        check_vllm_version("0.31.0", {ALLOW_UNTESTED_KEY: flag})


@pytest.mark.parametrize("flag", [True, "true", "TRUE"])
def test_opt_in_warns_and_loads(flag: object, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvbridge.vllm"):
        warning = check_vllm_version("0.31.0", {ALLOW_UNTESTED_KEY: flag})
    assert warning is not None and warning.startswith("vLLM 0.31.0 is not a release")
    assert "(tested: 0.30.0)" in warning and "loading anyway" in warning
    assert [r.getMessage() for r in caplog.records] == [warning]


@pytest.mark.parametrize("flag", [1, "yes", None, [True]])
def test_a_malformed_opt_in_is_refused_with_the_key(flag: object) -> None:
    with pytest.raises(UntestedVllmError, match=f"{ALLOW_UNTESTED_KEY}: expected true or false"):
        check_vllm_version("0.30.0", {ALLOW_UNTESTED_KEY: flag})


def test_the_tested_list_is_one_argument() -> None:
    assert check_vllm_version("0.31.0", {}, tested=("0.30.0", "0.31.0")) is None
