"""Compatibility hash of spec §1.5.

``sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()`` over exactly vLLM's
factor keys. TP size, block size, layout and DCP/PCP are deliberately not hashed: they are
checked at run time by :func:`validate_remote`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..rules import NIXL_CONNECTOR_VERSION
from ._errors import HashMismatchError

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompatibilityFactors:
    """The hashed factors, named as vLLM's dict keys. Values must be JSON-serialisable.

    ``dtype`` is ``str(model dtype)`` (e.g. ``"torch.bfloat16"``); ``cache_dtype`` is e.g.
    ``"auto"``/``"fp8"``; ``speculative_config`` is ``None`` or the EAGLE/MTP dict of §1.5;
    ``transfer_mode`` is ``"pull"`` or ``"push"``.
    """

    vllm_version: str
    model: str
    dtype: str
    num_kv_heads: int
    head_size: int
    num_hidden_layers: int
    attn_backend_name: str
    cache_dtype: str = "auto"
    is_hma_enabled: bool = True
    speculative_config: Mapping[str, Any] | None = None
    transfer_mode: str = "pull"
    nixl_connector_version: int = NIXL_CONNECTOR_VERSION

    def as_dict(self) -> dict[str, Any]:
        """The factor dict that is hashed."""
        factors = asdict(self)
        if self.speculative_config is not None:
            factors["speculative_config"] = dict(self.speculative_config)
        return factors


def compatibility_hash(factors: CompatibilityFactors | Mapping[str, Any]) -> str:
    """64-character SHA-256 hex of the sorted-key JSON of ``factors`` (spec §1.5).

    A plain mapping is hashed as given, so callers can reproduce a vLLM build's hash key by key.
    """
    data = factors.as_dict() if isinstance(factors, CompatibilityFactors) else dict(factors)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def check_compatibility(local_hash: str, remote_hash: str, *, enforce: bool = True) -> bool:
    """Compare hashes; True when equal.

    On mismatch raises :class:`HashMismatchError` when ``enforce`` (vLLM's
    ``enforce_handshake_compat``, default True), otherwise logs a warning and returns False.
    """
    if local_hash == remote_hash:
        return True
    if enforce:
        raise HashMismatchError(local_hash, remote_hash)
    _log.warning(
        "NIXL compatibility hash mismatch ignored (enforce_handshake_compat=false): "
        "local %s, remote %s",
        local_hash,
        remote_hash,
    )
    return False
