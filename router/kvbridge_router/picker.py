"""The endpoint picker's decision, pure: which decode an inference gateway sends a request to,
and which verified prefill it names for that decode's sidecar.

The Gateway API Inference Extension's endpoint-picker protocol (v1.0.0): the picker names the
destination ``ip:port`` in the request header ``x-gateway-destination-endpoint`` and in the
dynamic metadata ``envoy.lb`` under the same key (one value, the same in both); it picks only
among the gateway's subset hint (``envoy.lb.subset_hint`` /
``x-gateway-destination-endpoint-subset``) when one is sent, and answers 503 when nothing is
eligible. For P/D the destination is a decode, and the prefill goes in the header(s) the
decode's sidecar reads (sidecar.py). The pair comes from the one pair chooser (balance.py) over
the verified pairs (table.py): a decode with no verified prefill is never a destination.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .balance import Balancer, Decision, Pair, Prompt
from .sidecar import PREFILL_HEADERS, host_port, join_host_port
from .table import RoutingTable

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
#: a response header naming the pair that served (prefill->decode engine ids)
PAIR_HEADER = "x-kvbridge-pair"


@dataclass(frozen=True)
class PickerSettings:
    #: the port the InferencePool targets on each decode pod (its sidecar)
    target_port: int = 8000
    #: the prefills' OpenAI port where their KVEndpoint does not state one
    engine_port: int = 8000
    prefill_headers: Sequence[str] = PREFILL_HEADERS


@dataclass(frozen=True)
class Pick:
    decision: Decision
    destination: str
    #: request headers to set: the destination and the prefill for the sidecar
    headers: tuple[tuple[str, str], ...]

    @property
    def pair(self) -> Pair:
        return self.decision.pair


@dataclass(frozen=True)
class NoPick:
    status: int
    message: str


def decode_destination(pair: Pair, settings: PickerSettings) -> str:
    return join_host_port(pair.decode.host, settings.target_port)


def pick(table: RoutingTable, balancer: Balancer, settings: PickerSettings,
         subset: Collection[str] | None = None, prompt: Prompt | None = None
         ) -> Pick | NoPick:  # fmt: skip
    """The pair for one request, or why there is none (503). ``subset``: the gateway's hint,
    the only destinations allowed (None: the whole pool); ``prompt``: the request's blocks
    (the cache-aware policy reads the body for them)."""
    if not table.pairs:
        return NoPick(503, f"no verified prefill/decode pair: {table.reason}")
    allowed = None
    if subset is not None:
        allowed = {d.engine_id for d in table.decodes()
                   if f"{d.host}:{settings.target_port}" in subset
                   or f"[{d.host}]:{settings.target_port}" in subset}  # fmt: skip
        if not allowed:
            shown = ", ".join(sorted(subset)[:8]) or "empty"
            return NoPick(503, f"no decode of a verified pair is in the gateway's endpoint "
                          f"subset ({shown})")
    decision = balancer.decide(table, decodes=allowed, prompt=prompt)
    if decision is None:  # a table with pairs always yields one; kept for the type
        return NoPick(503, "no verified prefill/decode pair")
    pair = decision.pair
    destination = decode_destination(pair, settings)
    prefill = host_port(pair.prefill, settings.engine_port)
    headers = ((DESTINATION, destination),
               *((name, prefill) for name in settings.prefill_headers))  # fmt: skip
    return Pick(decision, destination, headers)
