"""The names the agent, the operator, the router and the CRDs share, and the default
deadlines: one place, so a rename or a new default is one edit."""

from __future__ import annotations

__all__ = [
    "API_VERSION",
    "DECODE",
    "ENDPOINTS",
    "ENDPOINT_KIND",
    "GROUP",
    "HANDSHAKE_TIMEOUT_S",
    "PREFILL",
    "ROLES",
    "TRANSFERS",
    "TRANSFER_KIND",
    "TRANSFER_TIMEOUT_S",
    "VERSION",
]

GROUP = "kvbridge.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
TRANSFER_KIND, TRANSFERS = "KVTransfer", "kvtransfers"
ENDPOINT_KIND, ENDPOINTS = "KVEndpoint", "kvendpoints"

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)

#: Default deadline of one transfer request, in seconds.
TRANSFER_TIMEOUT_S = 30.0
#: Default deadline of one side-channel handshake, in seconds.
HANDSHAKE_TIMEOUT_S = 5.0
