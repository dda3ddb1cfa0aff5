"""Which vLLM releases the connector loads in, and the opt-in for the others.

``KVBridgeConnector`` subclasses vLLM's NIXL connector and reads engine internals (the
scheduler, the KV cache config, the compatibility hash): across releases those move without
notice, and the connector version with them, so a release nobody tested can fail at the
first request or, worse, move the wrong bytes. The connector therefore refuses an untested
release at construction, naming it and the tested ones, unless the user opts in with
``kv_connector_extra_config.kvbridge_allow_untested_vllm = true``; then it warns and goes
on. Pure (no vLLM import), so the rule is tested where vLLM is not installed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..errors import KVBridgeError

__all__ = ["ALLOW_UNTESTED_KEY", "TESTED_VLLM_VERSIONS", "UntestedVllmError",
           "check_vllm_version"]

log = logging.getLogger("kvbridge.vllm")

#: vLLM releases the connector is tested with (the engine suite runs against each).
TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.30.0",)

#: ``kv_connector_extra_config`` key that lets the connector load in an untested release.
ALLOW_UNTESTED_KEY = "kvbridge_allow_untested_vllm"


class UntestedVllmError(KVBridgeError, RuntimeError):
    """The running vLLM release is not one the connector was tested with."""


def _release(version: str) -> str:
    """``version`` without its PEP 440 local part: ``0.30.0+cu128`` is the 0.30.0 release
    built for one CUDA; a dev or rc build (``0.30.1.dev3``) is another release."""
    return version.strip().split("+", 1)[0]


def _allowed(extra: Mapping[str, Any]) -> bool:
    value = extra.get(ALLOW_UNTESTED_KEY, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise UntestedVllmError(
        f"kv_connector_extra_config.{ALLOW_UNTESTED_KEY}: expected true or false, got "
        f"{value!r}")


def check_vllm_version(version: str, extra: Mapping[str, Any] | None = None,
                       tested: tuple[str, ...] = TESTED_VLLM_VERSIONS) -> str | None:
    """Refuse (:class:`UntestedVllmError`) an untested vLLM ``version`` unless ``extra``
    (``kv_connector_extra_config``) opts in; returns the warning logged when it does, None
    for a tested release."""
    allow = _allowed(extra or {})
    if _release(version) in tested:
        return None
    named = (f"vLLM {version} is not a release kvbridge's KVBridgeConnector was tested with "
             f"(tested: {', '.join(tested)})")
    if not allow:
        raise UntestedVllmError(
            f"{named}; refusing to load. Run a tested vLLM, or accept the risk with "
            f'--kv-transfer-config \'{{"kv_connector_extra_config": '
            f'{{"{ALLOW_UNTESTED_KEY}": true}}}}\'')
    warning = (f"{named}; loading anyway because {ALLOW_UNTESTED_KEY} is true: transfers may "
               "fail or be wrong")
    log.warning("%s", warning)
    return warning
