"""Verdict types of :func:`validate_remote`: rule ids, one problem, the verdict, options."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ._errors import ProtocolError


class Rule(StrEnum):
    """Identifier of the check that produced an :class:`Incompatibility`."""

    PROTOCOL_VERSION = "protocol_version"
    COMPATIBILITY_HASH = "compatibility_hash"
    TRANSFER_MODE = "transfer_mode"
    ENGINE_ID = "engine_id"
    TP_SIZE = "tp_size"
    DCP_SIZE = "dcp_size"
    PCP_SIZE = "pcp_size"
    REPLICATED_KV_HEADS = "replicated_kv_heads"
    MAMBA = "mamba"
    HOST_BUFFER = "host_buffer"
    KV_CACHE_LAYOUT = "kv_cache_layout"
    BLOCK_SIZE = "block_size"
    NUM_BLOCKS = "num_blocks"
    NUM_REGIONS = "num_regions"
    BLOCK_LENS = "block_lens"
    BLOCK_STRIDES = "block_strides"
    REGION_NUM_BLOCKS = "region_num_blocks"
    REGION_GROUP_IDS = "region_group_ids"
    REGION_NAMES = "region_names"
    REGION_MEM_TYPES = "region_mem_types"
    MIXED_MEMORY = "mixed_memory"
    PUSH_GROUP_LAYOUT = "push_group_layout"
    REGION_MAPPED = "region_mapped"


class Mode(StrEnum):
    PULL = "pull"
    PUSH = "push"


@dataclass(frozen=True)
class Incompatibility:
    """One failed check. ``message`` reads ``"<field>: local <v> <op> remote <v>: <why>"``.

    ``local`` is the value the remote is compared against: the local engine's value, or for
    topology expectations the expected value (``expected_*``), or for rules on the remote alone
    the reference it violates (the ``block_len`` a ``block_stride`` must cover).
    """

    rule: str
    field: str
    local: Any
    remote: Any
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": str(self.rule),
            "field": self.field,
            "local": self.local,
            "remote": self.remote,
            "message": self.message,
        }


@dataclass(frozen=True)
class Verdict:
    """All problems found; ``ok`` when there are none."""

    problems: tuple[Incompatibility, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rules(self) -> frozenset[str]:
        return frozenset(str(p.rule) for p in self.problems)

    def summary(self, limit: int | None = None) -> str:
        """One line: ``"compatible"`` or ``"N incompatibilities: msg; msg; ..."``."""
        if self.ok:
            return "compatible"
        shown = self.problems if limit is None else self.problems[:limit]
        more = len(self.problems) - len(shown)
        text = "; ".join(p.message for p in shown) + (f"; ... and {more} more" if more else "")
        noun = "incompatibility" if len(self.problems) == 1 else "incompatibilities"
        return f"{len(self.problems)} {noun}: {text}"

    def raise_for_problems(self) -> None:
        """Raise :class:`IncompatibleGeometryError` unless ``ok``."""
        if not self.ok:
            raise IncompatibleGeometryError(self)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.problems]


@dataclass(frozen=True)
class ValidationOptions:
    """Switches of the vLLM engine that change what is accepted (all default off/on as vLLM)."""

    enforce_handshake_compat: bool = True
    enable_permute_local_kv: bool = False
    host_buffer: bool = False
    prefix_caching: bool = True
    local_mem_type: str | None = None  # platform memory type for v10 fallback; None: derive


class IncompatibleGeometryError(ProtocolError):
    """:func:`validate_remote` found problems; ``verdict`` lists all of them. Defined beside
    :class:`Verdict`, which raises it, so the error tree imports nothing of ours."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.summary())
        self.verdict = verdict
