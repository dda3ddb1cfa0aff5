"""The KVEndpoint and KVTransfer ``status`` as field tables, the state values, and the
KVTransfer ``spec`` as a table too. Pure.

Three writers and three readers share these documents: the operator writes the verdict
(``state``, ``peers``, ...) and the KVTransfer status, the agent writes
``status.handshakes`` and reads its peers, the router reads both to route over verified
pairs. Each spells keys and states from here (a :class:`~._fields.FieldTable` names a field
by its ``attr``: ``HANDSHAKE_FIELDS.state.key``), and a unit test holds these tables and
the CRDs to each other, so a renamed key or a new state is one edit that the test follows.
"""

from __future__ import annotations

from enum import StrEnum

from ..rules import MODES
from ._fields import FieldTable, _f
from ._names import DECODE, PREFILL, ROLES

__all__ = [
    "BALANCED",
    "CONDITION_FIELDS",
    "DOES_NOT_EXIST",
    "ENDPOINT_STATUS_FIELDS",
    "EXISTS",
    "HANDSHAKE_FIELDS",
    "IN",
    "NOT_IN",
    "OPERATOR_STATUS_KEYS",
    "PAIRING_POLICIES",
    "PAIRS_FIELDS",
    "PAIR_FIELDS",
    "PEER_FIELDS",
    "PREFERRED",
    "PROBLEM_FIELDS",
    "REQUIRED",
    "REQUIREMENT_FIELDS",
    "REVISION_FIELDS",
    "ROLE_COUNT_FIELDS",
    "ROLE_SPEC_FIELDS",
    "SELECTOR_OPERATORS",
    "SPEC",
    "STATUS",
    "TOPOLOGY_AWARE",
    "TOPOLOGY_SCOPES",
    "TRANSFER_SPEC_FIELDS",
    "TRANSFER_STATUS_FIELDS",
    "ConditionStatus",
    "ConditionType",
    "EndpointState",
    "HandshakeState",
    "PairState",
    "RevisionReason",
    "revision_label",
    "same_model",
]

#: The parts of a resource document.
SPEC, STATUS = "spec", "status"


class EndpointState(StrEnum):
    """``KVEndpoint status.state``: the operator's verdict on one endpoint."""

    PENDING = "Pending"
    PAIRED = "Paired"
    UNPAIRED = "Unpaired"
    INCOMPATIBLE = "Incompatible"
    STALE = "Stale"
    EXCLUDED = "Excluded"
    ORPHANED = "Orphaned"  # spec.transferName names no KVTransfer (written outside plans)


class HandshakeState(StrEnum):
    """``KVEndpoint status.handshakes[].state``: how the agent's handshake with a peer ended."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class PairState(StrEnum):
    """``KVTransfer status.pairs.items[].state``: a decode/prefill engine pair."""

    PENDING = "Pending"
    VERIFIED = "Verified"
    FAILED = "Failed"


class ConditionStatus(StrEnum):
    """A condition's ``status``, as Kubernetes spells it."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    """The KVTransfer's condition types (``status.conditions[].type``)."""

    GEOMETRY_COMPATIBLE = "GeometryCompatible"
    PAIRED = "Paired"
    HANDSHAKES_VERIFIED = "HandshakesVerified"
    READY = "Ready"
    DEGRADED = "Degraded"
    REVISIONS_MATCHED = "RevisionsMatched"


class RevisionReason(StrEnum):
    """Reasons of the ``RevisionsMatched`` condition: every model revision present in a
    KVTransfer has both roles, or the first one that lacks a role."""

    ALL_PAIRED = "AllRevisionsPaired"
    WITHOUT_PREFILL = "RevisionWithoutPrefill"
    WITHOUT_DECODE = "RevisionWithoutDecode"
    WAITING = "WaitingForEngines"


def revision_label(revision: str, fingerprint: str) -> str:
    """How metrics, conditions and response headers name a model identity: the revision if
    stated, else the first 12 hex characters of the fingerprint (``sampled-v1:<hex>``), else
    ``unknown`` (agents that publish neither)."""
    if revision:
        return revision
    digest = fingerprint.rpartition(":")[2]
    return digest[:12] if digest else "unknown"


def same_model(fingerprint: str, revision: str, other_fingerprint: str,
               other_revision: str) -> bool:  # fmt: skip
    """Whether two engines serve the same weights, so that one may read the other's KV:
    equal fingerprints (empty only with empty: agents that publish none) and equal revisions
    where both state one. The operator pairs by this rule; the fronts check it again."""
    return fingerprint == other_fingerprint and (
        not revision or not other_revision or revision == other_revision)


def _values(enum: type[StrEnum]) -> tuple[str, ...]:
    return tuple(e.value for e in enum)


# -- KVEndpoint ---------------------------------------------------------------------------------

#: One ``status.peers`` item: a peer the operator assigned.
PEER_FIELDS = FieldTable((
    _f("name", "name", str),
    _f("engineId", "engine_id", str),
    _f("role", "role", str, default="", choices=ROLES),
    _f("host", "host", str, default=""),
    _f("port", "port", int, default=0),
    _f("tpRank", "tp_rank", int),
    _f("tpSize", "tp_size", int, default=1),
    _f("epoch", "epoch", int),
))

#: One ``status.handshakes`` item: the agent's result with one peer.
HANDSHAKE_FIELDS = FieldTable((
    _f("peer", "peer", str),
    _f("engineId", "engine_id", str, default=""),
    _f("epoch", "epoch", int),
    _f("state", "state", str, choices=_values(HandshakeState)),
    _f("message", "message", str, default="", omit_empty=True),
    _f("time", "time", str, default=""),
    _f("transport", "transport", str, default="", omit_empty=True),
    _f("transportDetail", "transport_detail", str, default=""),
))

_HANDSHAKES = _f("handshakes", "handshakes", list, default=(), fields=HANDSHAKE_FIELDS)

#: KVEndpoint ``status``: ``handshakes`` is the agent's, every other field the operator's.
ENDPOINT_STATUS_FIELDS = FieldTable((
    _f("observedGeneration", "observed_generation", int, default=0),
    _f("observedEpoch", "observed_epoch", int, default=-1),
    _f("state", "state", str, default=EndpointState.PENDING.value,
       choices=_values(EndpointState)),
    _f("reason", "reason", str, default=""),
    _f("message", "message", str, default=""),
    _f("peers", "peers", list, default=(), fields=PEER_FIELDS),
    _HANDSHAKES,
))

#: The KVEndpoint status keys the operator owns (it never writes the agent's handshakes).
OPERATOR_STATUS_KEYS: tuple[str, ...] = tuple(
    f.key for f in ENDPOINT_STATUS_FIELDS if f is not _HANDSHAKES)


# -- KVTransfer ---------------------------------------------------------------------------------

#: ``status.prefill`` / ``status.decode``: the counts of one role.
ROLE_COUNT_FIELDS = FieldTable(tuple(
    _f(key, key, int, default=0)
    for key in ("engines", "endpoints", "incompatible", "stale", "incomplete", "paired",
                "verified")
))

#: One ``status.pairs.items`` item.
PAIR_FIELDS = FieldTable((
    _f("decodeEngine", "decode_engine", str, default=""),
    _f("prefillEngine", "prefill_engine", str, default=""),
    _f("state", "state", str, default=PairState.PENDING.value, choices=_values(PairState)),
    _f("transports", "transports", list, default=()),
))

#: ``status.pairs``.
PAIRS_FIELDS = FieldTable((
    _f("total", "total", int, default=0),
    _f("verified", "verified", int, default=0),
    _f("items", "listed", list, default=(), fields=PAIR_FIELDS),
))

#: One ``status.incompatible`` item: an endpoint a rule kept from pairing.
PROBLEM_FIELDS = FieldTable((
    _f("endpoint", "endpoint", str, default=""),
    _f("role", "role", str, default=""),
    _f("rule", "rule", str, default=""),
    _f("field", "field", str, default=""),
    _f("message", "message", str, default=""),
))

#: One ``status.revisions`` item: the engines and pairs of one model identity.
REVISION_FIELDS = FieldTable((
    _f("model", "model", str, default=""),
    _f("revision", "revision", str, default=""),
    _f("fingerprint", "fingerprint", str, default=""),
    _f("prefills", "prefills", int, default=0),
    _f("decodes", "decodes", int, default=0),
    _f("pairs", "pairs", int, default=0),
))

#: One ``status.conditions`` item (Kubernetes API conventions).
CONDITION_FIELDS = FieldTable((
    _f("type", "type", str),
    _f("status", "status", str, choices=_values(ConditionStatus)),
    _f("reason", "reason", str, default=""),
    _f("message", "message", str, default=""),
    _f("lastTransitionTime", "last_transition_time", str, default=""),
    _f("observedGeneration", "observed_generation", int, default=0),
))

#: KVTransfer ``status``, all the operator's.
TRANSFER_STATUS_FIELDS = FieldTable((
    _f("observedGeneration", "observed_generation", int, default=0),
    _f("summary", "summary", str, default=""),
    _f(PREFILL, PREFILL, dict, default=None, fields=ROLE_COUNT_FIELDS),
    _f(DECODE, DECODE, dict, default=None, fields=ROLE_COUNT_FIELDS),
    _f("pairs", "pairs", dict, default=None, fields=PAIRS_FIELDS),
    _f("incompatible", "incompatible", list, default=(), fields=PROBLEM_FIELDS),
    _f("revisions", "revisions", list, default=(), fields=REVISION_FIELDS),
    _f("conditions", "conditions", list, default=(), fields=CONDITION_FIELDS),
))


# -- KVTransfer spec ----------------------------------------------------------------------------

#: ``spec.prefill.selector.matchExpressions`` operators: with values, then without.
IN, NOT_IN, EXISTS, DOES_NOT_EXIST = "In", "NotIn", "Exists", "DoesNotExist"
SELECTOR_OPERATORS: tuple[str, ...] = (IN, NOT_IN, EXISTS, DOES_NOT_EXIST)

#: One ``spec.<role>.selector.matchExpressions`` item.
REQUIREMENT_FIELDS = FieldTable((
    _f("key", "key", str),
    _f("operator", "operator", str, choices=SELECTOR_OPERATORS),
    _f("values", "values", list, default=[]),
))

#: ``spec.prefill`` / ``spec.decode``: one role of the topology.
ROLE_SPEC_FIELDS = FieldTable((
    _f("tensorParallelSize", "tp_size", int),
    _f("selector", "selector", dict, default=None, fields=FieldTable((
        _f("matchLabels", "match_labels", dict, default=None),
        _f("matchExpressions", "match_expressions", list, default=(),
           fields=REQUIREMENT_FIELDS),
    ))),
    _f("expectedGeometry", "expected", dict, default=None, fields=FieldTable((
        _f("blockSize", "block_size", int, default=None),
        _f("kvCacheLayout", "kv_cache_layout", str, default=None),
        _f("attentionBackend", "attention_backend", str, default=None),
        _f("numRegions", "num_regions", int, default=None),
    ))),
))

#: ``spec.pairing.policy`` and ``spec.pairing.topologyScope`` values (the first: the default).
BALANCED, TOPOLOGY_AWARE = "Balanced", "TopologyAware"
PAIRING_POLICIES: tuple[str, ...] = (BALANCED, TOPOLOGY_AWARE)
PREFERRED, REQUIRED = "Preferred", "Required"
TOPOLOGY_SCOPES: tuple[str, ...] = (PREFERRED, REQUIRED)

#: KVTransfer ``spec``, in the order the operator's parser reads it; ``default`` is the
#: CRD's default where it states one.
TRANSFER_SPEC_FIELDS = FieldTable((
    _f("protocolVersion", "protocol_version", int),
    _f("mode", "mode", str, default=MODES[0], choices=MODES),
    _f("sideChannelPort", "side_channel_port", int, default=5600),
    _f(PREFILL, PREFILL, dict, fields=ROLE_SPEC_FIELDS),
    _f(DECODE, DECODE, dict, fields=ROLE_SPEC_FIELDS),
    _f("pairing.policy", "policy", str, default=PAIRING_POLICIES[0], choices=PAIRING_POLICIES),
    _f("pairing.topologyKey", "topology_key", str, default=""),
    _f("pairing.topologyScope", "topology_scope", str, default=TOPOLOGY_SCOPES[0],
       choices=TOPOLOGY_SCOPES),
    _f("pairing.prefillPerDecode", "prefill_per_decode", int, default=1),
    _f("compatibility.enforceHash", "enforce_hash", bool, default=True),
    _f("transport.accepted", "accepted_transports", list, default=[]),
))
