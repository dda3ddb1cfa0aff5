"""The model a vLLM engine serves, as its KVEndpoint states it, read from the engine's
config once at worker start-up (see :mod:`kvbridge_agent.identity`).

Duck-typed on ``vllm_config`` and importing no vLLM, so the settings it refuses are tested
where vLLM is not installed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..identity import DIGEST_MODES, ModelIdentity, identify_model
from ._errors import UnsupportedVllmSettingError

__all__ = ["DIGEST_KEY", "model_digest", "served_model_name", "vllm_model_identity"]

log = logging.getLogger("kvbridge.vllm")

#: The ``kv_connector_extra_config`` key choosing the fingerprint mode.
DIGEST_KEY = "kvbridge_model_digest"


def model_digest(extra: Mapping[str, Any]) -> str:
    """``kvbridge_model_digest`` from ``kv_connector_extra_config``: ``sampled`` (default),
    ``full`` or ``off``; anything else is refused before the engine serves."""
    value = extra.get(DIGEST_KEY, "sampled")
    if not isinstance(value, str) or value not in DIGEST_MODES:
        raise UnsupportedVllmSettingError(
            f"kv_connector_extra_config.{DIGEST_KEY}={value!r}: expected one of "
            f"{', '.join(repr(m) for m in DIGEST_MODES)} (default 'sampled')")
    return value


def served_model_name(model_config: Any) -> str:
    """The name clients ask for: the first ``--served-model-name``, else the model (path or
    repository id) as vLLM was given it."""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model_config.model)


def vllm_model_identity(vllm_config: Any, extra: Mapping[str, Any], vllm_version: str
                        ) -> ModelIdentity:  # fmt: skip
    """The identity of the model ``vllm_config`` serves, its fingerprint taken as
    ``kvbridge_model_digest`` says. A model file that cannot be read publishes no
    fingerprint (with a warning) rather than stop the engine: such an endpoint pairs only
    with others that have none, never with one that may serve other weights."""
    digest = model_digest(extra)
    mc = vllm_config.model_config
    name, model = served_model_name(mc), str(mc.model)
    revision = getattr(mc, "revision", None) or None
    try:
        return identify_model(name, model, revision, digest=digest, vllm_version=vllm_version)
    except OSError as exc:
        log.warning("kvbridge: cannot fingerprint model %r (%s): publishing no model "
                    "fingerprint", model, exc)
        return identify_model(name, model, revision, digest="off", vllm_version=vllm_version)
