"""The NIXL connector version this package speaks, and its history (spec §1.4).

A module of its own, importing nothing, so the wire format, the compatibility hash and the
engine geometry all read the one constant without importing one another.

History: 1 compatibility hash · 2 remote_request_id · 3 ppl field · 4 lease heartbeats ·
5 expiry time + clock-sync timestamp · 6 speculative config in hash · 7 transfer mode in hash ·
8 dcp_size/pcp_size · 9 block_strides · 10 dense virtual pages for compressed MLA · 11
per-region geometry and memory types · 12 (later, not implemented) region_members for PP push.
"""

NIXL_CONNECTOR_VERSION = 11
