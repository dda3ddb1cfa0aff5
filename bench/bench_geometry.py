"""Descriptor-id throughput of kvbridge_agent.geometry.compute_desc_ids vs a plain-Python
reference, on realistic DeepSeek-style shapes (spec §9.2): block size 64, so an 8k-token
prompt is 128 blocks and a 128k-token prompt 2048 blocks, with 20,000-block pools.

Three JSON lines per shape, all against one plain-Python reference measurement (Python
lists in, list out; same ids, same run); value = descriptor ids per second (millions),
ratio = value / reference value (higher is better):

- ``geometry.desc_ids.<shape>``: ``compute_desc_ids`` on int64 arrays, as the data path
  hands them over after ``expand_logical_to_kernel``/``block_ids_by_region``;
- ``geometry.desc_ids_layout.<shape>``: ``DescIdLayout.desc_ids`` (layout built once per
  engine, outside the timed loop), same arrays;
- ``geometry.desc_ids_lists.<shape>``: ``compute_desc_ids`` on Python lists, including
  the list -> array conversion.
"""

from __future__ import annotations

import random

import numpy as np

from _common import best_time, emit
from kvbridge_agent.geometry import DescIdLayout, compute_desc_ids

POOL = 20_000


def reference_desc_ids(block_ids, caps, gids, uses=None):
    """Spec §3.2–§3.5 in plain Python (no numpy)."""
    offsets, acc = [], 0
    for c in caps:
        offsets.append(acc)
        acc += c
    if uses is None:
        uses = len(set(gids)) > 1
    if not uses:
        flat = [b for entry in block_ids for b in entry]
        return [o + b for o in offsets for b in flat]
    out = []
    for g, entry in enumerate(block_ids):
        if entry:
            out.extend(o + b for r, o in enumerate(offsets) if gids[r] in (g, -1)
                       for b in entry)
    return out


def shapes(rng: random.Random):
    for tokens, blocks in ((8_192, 128), (131_072, 2_048)):
        tag = f"{tokens // 1024}k"

        def ids(n: int = blocks) -> list[int]:
            return rng.sample(range(POOL), n)

        # DeepSeek-V3: 61 MLA regions, one group (fast path)
        yield f"mla61_{tag}", [ids()], [POOL] * 61, [0] * 61, None
        # DeepSeek-V3.2: 122 regions (MLA + indexer), two groups (group-mapped path)
        yield f"mla122_2groups_{tag}", [ids(), ids()], [POOL] * 122, [0, 1] * 61, None
        # HiSparse-style: 61 shared regions + 61 host-pool regions in group 1 of their own
        caps = [POOL] * 61 + [POOL // 2] * 61
        yield (f"shared61_plus_group61_{tag}",
               [ids(), rng.sample(range(POOL // 2), blocks)], caps, [-1] * 61 + [1] * 61,
               None)
        # region-mapped read: one list per region, identity group ids
        yield (f"region_mapped61_{tag}", [ids() for _ in range(61)], [POOL] * 61,
               list(range(61)), True)


def run_shape(name, block_ids, caps, gids, uses) -> None:
    arrays = [np.asarray(b, dtype=np.int64) for b in block_ids]
    caps_a, gids_a = np.asarray(caps, dtype=np.int64), np.asarray(gids, dtype=np.int64)
    layout = DescIdLayout(caps_a, gids_a, uses_group_mapping=uses)
    want = reference_desc_ids(block_ids, caps, gids, uses)
    variants = {
        "desc_ids": lambda: compute_desc_ids(arrays, caps_a, gids_a, uses_group_mapping=uses),
        "desc_ids_layout": lambda: layout.desc_ids(arrays),
        "desc_ids_lists": lambda: compute_desc_ids(block_ids, caps, gids,
                                                   uses_group_mapping=uses),
    }
    for variant, fn in variants.items():
        if fn().tolist() != want:
            raise SystemExit(f"{name}/{variant}: vectorized and reference ids differ")
    n = len(want)
    slow = best_time(lambda: reference_desc_ids(block_ids, caps, gids, uses),
                     min_time=0.15, repeat=3)
    base = n / slow / 1e6
    for variant, fn in variants.items():
        fast = best_time(fn, min_time=0.1, repeat=5)
        value = n / fast / 1e6
        emit(
            f"geometry.{variant}.{name}",
            round(value, 3),
            "Mdesc/s",
            "plain-Python reference on lists (same ids, same run)",
            round(value / base, 2),
            baseline_value=round(base, 3),
            higher_is_better=True,
            descs=n,
            regions=len(caps),
            groups=len(block_ids),
            us_per_call=round(fast * 1e6, 1),
            baseline_us_per_call=round(slow * 1e6, 1),
        )


def main() -> None:
    for shape in shapes(random.Random(20260908)):
        run_shape(*shape)


if __name__ == "__main__":
    main()
