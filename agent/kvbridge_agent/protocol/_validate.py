"""Remote validation: spec §1.6 (pre-v11 and v11 checks) plus the §10.11 rejections.

One pure function, :func:`validate_remote`, shared by the agent's handshake and the operator's
planner, so what the operator admits is exactly what the handshake accepts. It never stops at
the first problem: the returned :class:`Verdict` lists every incompatibility, each naming the
rule, the field and both values.

Orientation: ``local`` is the engine running the check and ``remote`` the peer whose metadata
arrived. In pull mode that is local = D (decode), remote = P (prefill), as in vLLM.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from .. import rules
from ._consistency import incompatibility
from ._engine import EffectiveRegions, EngineGeometry, effective_regions
from ._verdict import Incompatibility, Mode, Rule, ValidationOptions, Verdict


class _Collector:
    def __init__(self) -> None:
        self.problems: list[Incompatibility] = []

    def add(
        self,
        rule: Rule,
        field: str,
        local: Any,
        remote: Any,
        why: str,
        op: str = "!=",
    ) -> None:
        msg = f"{field}: local {local!r} {op} remote {remote!r}: {why}"
        self.problems.append(Incompatibility(rule, field, local, remote, msg))

    def found(self, finding: rules.Finding | None, *sides: Any) -> None:
        """A rule-table finding (``sides``: the local and remote values compared)."""
        if finding is not None:
            self.problems.append(incompatibility(finding, *sides))


def validate_remote(
    local: EngineGeometry,
    remote: EngineGeometry,
    *,
    mode: str = "pull",
    expected_engine_id: str | None = None,
    expected_tp_size: int | None = None,
    expected_dcp_size: int | None = None,
    expected_num_blocks: int | None = None,
    options: ValidationOptions | None = None,
) -> Verdict:
    """Check ``remote`` against ``local``; returns a :class:`Verdict` with every problem.

    ``expected_*`` are what the request's topology says about the remote (``remote_engine_id``,
    ``tp_size``, ``dcp_size``, and the ``num_blocks`` already recorded for that engine); each
    is checked only when given. Pure: no I/O, never raises for bad input values.
    """
    opts = options or ValidationOptions()
    mode = Mode(mode)
    c = _Collector()
    _check_identity(c, local, remote, mode, expected_engine_id, opts)
    _check_parallel(c, local, remote, expected_tp_size, expected_dcp_size)
    bsr = _check_block_size(c, local, remote, opts)
    if not local.is_mla and local.kv_cache_layout != remote.kv_cache_layout:
        permuted = (remote.kv_cache_layout, local.kv_cache_layout) == ("LBHNC", "LBNHC")
        if not (permuted and opts.enable_permute_local_kv):
            c.add(
                Rule.KV_CACHE_LAYOUT,
                "kv_cache_layout",
                local.kv_cache_layout,
                remote.kv_cache_layout,
                "non-MLA models need the same KV cache layout",
            )
    if expected_num_blocks is not None and remote.num_blocks != expected_num_blocks:
        c.add(
            Rule.NUM_BLOCKS,
            "num_blocks",
            expected_num_blocks,
            remote.num_blocks,
            "all ranks of one remote engine must report the same kernel block count",
        )
    _check_regions(c, local, remote, bsr)
    _check_memory_and_groups(c, local, remote, mode, bsr, opts)
    return Verdict(tuple(c.problems))


def _check_identity(
    c: _Collector,
    local: EngineGeometry,
    remote: EngineGeometry,
    mode: Mode,
    expected_engine_id: str | None,
    opts: ValidationOptions,
) -> None:
    for side, geom in (("local", local), ("remote", remote)):
        c.found(rules.protocol_version(geom.protocol_version, note=f"{side} engine"),
                local.protocol_version, remote.protocol_version)
    lh, rh = local.compatibility_hash, remote.compatibility_hash
    if opts.enforce_handshake_compat and lh is not None and rh is not None and lh != rh:
        c.add(
            Rule.COMPATIBILITY_HASH,
            "compatibility_hash",
            lh,
            rh,
            "NIXL compatibility hash mismatch: prefill and decode configurations differ "
            "(or set enforce_handshake_compat=false)",
        )
    for side, geom in (("local", local), ("remote", remote)):
        if geom.transfer_mode is not None and geom.transfer_mode != mode:
            c.add(
                Rule.TRANSFER_MODE,
                "transfer_mode",
                local.transfer_mode,
                remote.transfer_mode,
                f"{side} engine is not in {mode.value} mode",
            )
    if expected_engine_id is not None and remote.engine_id != expected_engine_id:
        c.add(
            Rule.ENGINE_ID,
            "engine_id",
            expected_engine_id,
            remote.engine_id,
            "Remote NIXL agent engine ID mismatch (local value = expected remote_engine_id)",
        )


def _check_parallel(
    c: _Collector,
    local: EngineGeometry,
    remote: EngineGeometry,
    expected_tp: int | None,
    expected_dcp: int | None,
) -> None:
    mamba = local.has_mamba or remote.has_mamba
    if expected_tp is not None and remote.tp_size != expected_tp:
        c.add(
            Rule.TP_SIZE,
            "tp_size",
            expected_tp,
            remote.tp_size,
            "remote TP size differs from the topology (local value = expected remote TP)",
        )
    divides = {k: rules.sizes_divide(k, getattr(remote, f"{k}_size"), getattr(local, f"{k}_size"),
                                     field=f"{k}_size", other_field=f"the local {k}_size")
               for k in ("tp", "dcp", "pcp")}
    c.found(divides["tp"], local.tp_size, remote.tp_size)
    if expected_dcp is not None and remote.dcp_size != expected_dcp:
        c.add(
            Rule.DCP_SIZE,
            "dcp_size",
            expected_dcp,
            remote.dcp_size,
            "remote DCP size differs from the topology (local value = expected remote DCP)",
        )
    c.found(divides["dcp"], local.dcp_size, remote.dcp_size)
    if not divides["dcp"] and local.is_mla and mamba and local.dcp_size != remote.dcp_size:
        c.add(
            Rule.DCP_SIZE,
            "dcp_size",
            local.dcp_size,
            remote.dcp_size,
            "hybrid MLA+Mamba models require equal DCP sizes",
        )
    c.found(divides["pcp"], local.pcp_size, remote.pcp_size)
    heads = local.num_kv_heads
    if (
        not local.is_mla
        and not mamba
        and heads
        and remote.tp_size > local.tp_size
        and remote.tp_size > heads
    ):
        c.add(
            Rule.REPLICATED_KV_HEADS,
            "tp_size",
            local.tp_size,
            remote.tp_size,
            f"P TP > D TP with replicated KV heads ({heads} KV heads) is not supported",
            op="<",
        )


def _check_block_size(
    c: _Collector, local: EngineGeometry, remote: EngineGeometry, opts: ValidationOptions
) -> int | None:
    lb, rb = local.block_size, remote.block_size
    if lb <= 0 or rb <= 0 or lb % rb != 0:
        c.add(
            Rule.BLOCK_SIZE,
            "block_size",
            lb,
            rb,
            "the local kernel block size must be a positive multiple of the remote one "
            "(block_size_ratio = local // remote >= 1)",
            op="vs",
        )
        return None
    bsr = lb // rb
    if bsr != 1 and opts.host_buffer:
        c.add(
            Rule.HOST_BUFFER,
            "block_size",
            lb,
            rb,
            "block_size_ratio != 1 is not supported with a host buffer",
        )
    lp = local.physical_blocks_per_logical_kv_block
    rp = remote.physical_blocks_per_logical_kv_block
    if (local.has_mamba or remote.has_mamba) and opts.prefix_caching and lp != rp:
        c.add(
            Rule.MAMBA,
            "physical_blocks_per_logical_kv_block",
            lp,
            rp,
            "Mamba models with prefix caching need the same ppl on both sides",
        )
    return bsr


def _check_regions(
    c: _Collector, local: EngineGeometry, remote: EngineGeometry, bsr: int | None
) -> None:
    r = local.num_regions
    if remote.num_regions != r:
        c.add(
            Rule.NUM_REGIONS,
            "len(block_lens)",
            r,
            remote.num_regions,
            "P and D must have the same number of transfer regions",
        )
    if remote.num_base_addrs is not None and remote.num_base_addrs != r:
        c.add(
            Rule.NUM_REGIONS,
            "len(kv_caches_base_addr)",
            r,
            remote.num_base_addrs,
            "P and D must have the same number of transfer regions",
        )
    # Per-region lists are checked against the remote's own R: a differing R is reported once
    # above, and a list that disagrees with its own R is what spec §1.6 asserts against.
    lists = {n: getattr(remote, n) for n in rules.PER_REGION_LISTS[1:]}
    for finding in (*rules.check_lengths(remote.num_regions, lists),
                    *rules.check_strides(remote.block_lens, remote.block_strides)):
        c.found(finding)
    ln, rn = local.region_names, remote.region_names
    if ln is not None and rn is not None:
        for i, (a, b) in enumerate(zip(ln, rn, strict=False)):
            if a != b:
                c.add(
                    Rule.REGION_NAMES,
                    f"region_names[{i}]",
                    a,
                    b,
                    "NIXL transfer regions must name the same model caches in the same order",
                )
    if bsr is not None and remote.num_regions == r:
        _check_block_lens(c, local, remote, bsr)


def _check_block_lens(
    c: _Collector, local: EngineGeometry, remote: EngineGeometry, bsr: int
) -> None:
    mamba = local.has_mamba or remote.has_mamba
    heads = local.num_kv_heads
    replicated = local.is_mla or bool(heads and remote.tp_size > heads)
    p_gt_d = remote.tp_size > local.tp_size
    if local.is_mla and mamba:
        why = "hybrid MLA+SSM: local block_len must equal remote block_len x block_size_ratio"
        for i, (lv, rv) in enumerate(zip(local.block_lens, remote.block_lens, strict=True)):
            if lv != rv * bsr:
                c.add(Rule.BLOCK_LENS, f"block_lens[{i}]", lv, rv, why + f" ({bsr})")
        return
    if not replicated and p_gt_d and bsr != 1:
        c.add(
            Rule.BLOCK_LENS,
            "block_size",
            local.block_size,
            remote.block_size,
            "split (head-sliced) regions with P TP > D TP need equal kernel block sizes",
        )
        return
    if replicated:
        scale = Fraction(1, bsr)
        why = f"replicated region: local block_len // block_size_ratio ({bsr}) must equal remote"
    else:
        if heads:
            lh, rh = max(1, heads // local.tp_size), max(1, heads // remote.tp_size)
        else:
            lh, rh = remote.tp_size, local.tp_size  # heads per rank scale as 1/TP
        scale = Fraction(rh, lh * bsr)
        why = (
            f"split region: remote block_len must be local x remote_heads/local_heads "
            f"// block_size_ratio = local x {scale}"
        )
    for i, (lv, rv) in enumerate(zip(local.block_lens, remote.block_lens, strict=True)):
        expected = lv * scale
        ok = (lv // bsr == rv) if replicated else (expected == rv)
        if not ok:
            c.add(Rule.BLOCK_LENS, f"block_lens[{i}]", lv, rv, why)


def _local_effective(local: EngineGeometry, mem_type: str) -> EffectiveRegions:
    return effective_regions(local, local_region_group_ids=None, local_mem_type=mem_type)


def _check_memory_and_groups(
    c: _Collector,
    local: EngineGeometry,
    remote: EngineGeometry,
    mode: Mode,
    bsr: int | None,
    opts: ValidationOptions,
) -> None:
    mem_type = opts.local_mem_type
    if mem_type is None:
        types = local.region_mem_types or ("VRAM",)
        mem_type = "VRAM" if "VRAM" in types else types[0]
    mine = _local_effective(local, mem_type)
    theirs = effective_regions(
        remote, local_region_group_ids=local.region_group_ids, local_mem_type=mem_type
    )
    mamba = local.has_mamba or remote.has_mamba
    kinds = sorted(set(mine.mem_types)), sorted(set(theirs.mem_types))
    # local = D, the consumer; remote = P, the producer (in both modes)
    c.found(rules.mixed_needs_mla(mine.mem_types, is_mla=local.is_mla, mamba=mamba,
                                  note="local engine"), *kinds)
    c.found(rules.single_memory(mine.mem_types, mode=mode, producer=False, note="local engine")
            or rules.single_memory(theirs.mem_types, mode=mode, producer=True,
                                   note="remote engine"), *kinds)
    if len(theirs.group_ids) != len(mine.group_ids) or theirs.group_ids == mine.group_ids:
        return  # equal layouts, or a length problem already reported
    if mode is Mode.PUSH:
        c.found(rules.push_group_layout(theirs.group_ids, mine.group_ids),
                list(mine.group_ids), list(theirs.group_ids))
        return
    needs = []
    if not local.is_mla:
        needs.append("a pure MLA model")
    if mamba:
        needs.append("no Mamba layers")
    if bsr is not None and bsr != 1:
        needs.append(f"equal kernel block sizes (block_size_ratio is {bsr})")
    if needs:
        c.add(
            Rule.REGION_MAPPED,
            "region_group_ids",
            list(mine.group_ids),
            list(theirs.group_ids),
            "different cache-group layouts need region-mapped reads, which require "
            + ", ".join(needs),
        )
