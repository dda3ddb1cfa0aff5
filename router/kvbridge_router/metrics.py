"""The router's Prometheus metrics, in a registry of their own (served on ``/metrics``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from .balance import Decision, Pair

REGISTRY = CollectorRegistry(auto_describe=True)

#: Values of ``outcome``, one per request (tally.py): answered (the decode's answer, streamed
#: to its end); rejected (the client's mistake: a 4xx from the router, the prefill or the
#: decode); no_pair (503: nothing verified); failed (prefill or decode failed on every
#: attempt); stream_error (the decode failed after the first byte: the stream ended with an
#: error event); cancelled (the client went away before its answer was complete); shutdown
#: (the router's drain grace ended first: a 503, or the stream ended with an error event).
OUTCOMES = ("answered", "rejected", "no_pair", "failed", "stream_error", "cancelled",
            "shutdown")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter(
    "kvbridge_router_requests", "Requests by outcome and by the pair that served them "
    "(prefill and decode engine ids and the model revision; empty when none did)",
    ["outcome", "prefill", "decode", "revision"], registry=REGISTRY)
RETRIES = Counter(
    "kvbridge_router_retries", "Requests sent again on another pair, by the step that failed "
    "(prefill, decode) or by the lease rule (lease: the prefill answer was too old)",
    ["stage"], registry=REGISTRY)
PREFILL_SECONDS = Histogram(
    "kvbridge_router_prefill_seconds", "The prefill call (prompt computed, KV kept)",
    buckets=LATENCY_BUCKETS, registry=REGISTRY)
DECODE_SECONDS = Histogram(
    "kvbridge_router_decode_seconds", "The decode call, to the last byte of its answer",
    buckets=LATENCY_BUCKETS, registry=REGISTRY)
TOTAL_SECONDS = Histogram(
    "kvbridge_router_request_seconds", "Whole requests, retries included",
    buckets=LATENCY_BUCKETS, registry=REGISTRY)
TTFT_SECONDS = Histogram(
    "kvbridge_router_time_to_first_token_seconds",
    "From the request's arrival to the decode's first byte", buckets=LATENCY_BUCKETS,
    registry=REGISTRY)
VERIFIED_PAIRS = Gauge(
    "kvbridge_router_verified_pairs", "Pairs requests may take now (see /health)",
    registry=REGISTRY)
OUTSTANDING = Gauge(
    "kvbridge_router_outstanding", "Requests in flight per engine", ["engine", "role"],
    registry=REGISTRY)
DRAINING = Gauge(
    "kvbridge_router_draining", "1 from SIGTERM until the process exits: /ready answers 503, "
    "requests are still taken for the drain delay, then those in flight get the drain grace",
    registry=REGISTRY)
DRAIN_CUTS = Counter(
    "kvbridge_router_drain_cut_requests", "Requests still in flight when the drain grace "
    "ended, by stage (waiting: no answer started, answered 503; streaming: the stream ended "
    "with an error event and no [DONE])", ["stage"], registry=REGISTRY)
INFO = Gauge(
    "kvbridge_router_info", "The KVTransfer this router serves (always 1); join the other "
    "series with it by instance for their namespace and transfer", ["namespace", "transfer"],
    registry=REGISTRY)


def pair_labels(pair: Pair | None) -> tuple[str, str, str]:
    """The prefill, decode and revision labels of the pair that served (empty: none did).
    The revision follows from the pair, so it adds no series of its own."""
    if pair is None:
        return ("", "", "")
    return (pair.prefill.engine_id, pair.decode.engine_id, pair.revision)


def init_series() -> None:
    """Every outcome and retry stage at 0 from the start (pair labels empty), so that rates
    and the dashboard's panels have a series before the first request or failure."""
    for outcome in OUTCOMES:
        REQUESTS.labels(outcome, "", "", "")
    for stage in ("prefill", "decode", "lease"):
        RETRIES.labels(stage)
    for stage in ("waiting", "streaming"):
        DRAIN_CUTS.labels(stage)
    for policy in ("least-load", "cache-aware"):   # balance.POLICIES
        PICK_PROMPT_BLOCKS.labels(policy)
        for role in ("prefill", "decode"):
            PICK_HIT_BLOCKS.labels(policy, role)
            PICK_EVICTED_BLOCKS.labels(policy, role)

# The endpoint picker (kvbridge-router epp): its own process, the same registry.
PICKS = Counter(
    "kvbridge_picker_requests", "Requests the inference gateway asked the endpoint picker "
    "about, by outcome (picked: a verified pair named; no_pair: 503, nothing verified or "
    "eligible) and by the pair named and its model revision",
    ["outcome", "prefill", "decode", "revision"], registry=REGISTRY)
PICK_SECONDS = Histogram(
    "kvbridge_picker_decision_seconds", "From the request headers' arrival to the pick",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
    registry=REGISTRY)
PICKER_STREAMS = Gauge(
    "kvbridge_picker_streams", "ext_proc streams (requests) the gateway has open now",
    registry=REGISTRY)
PICKER_DRAINING = Gauge(
    "kvbridge_picker_draining", "1 from SIGTERM until the process exits: gRPC readiness is "
    "NOT_SERVING, streams are still taken for the drain delay, then those open get the drain "
    "grace", registry=REGISTRY)
PICKER_DRAIN_CUTS = Counter(
    "kvbridge_picker_drain_cut_streams", "ext_proc streams still open when the drain grace "
    "ended, cancelled: the gateway fails their requests", registry=REGISTRY)

# The pair chooser (balance.py), in every front that chooses: each decision's parts.
BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
PICK_PROMPT_BLOCKS = Histogram(
    "kvbridge_router_pick_prompt_blocks", "KV blocks of each chosen request's prompt",
    ["policy"], buckets=BLOCK_BUCKETS, registry=REGISTRY)
PICK_HIT_BLOCKS = Histogram(
    "kvbridge_router_pick_cache_hit_blocks", "Leading prompt blocks the chosen engine held in "
    "its prefix cache, by role (prefill: not computed; decode: not pulled); the hit rate is "
    "this histogram's sum over the prompt blocks' sum", ["policy", "role"],
    buckets=BLOCK_BUCKETS, registry=REGISTRY)
PICK_EVICTED_BLOCKS = Histogram(
    "kvbridge_router_pick_evicted_blocks", "Blocks the chosen engine was estimated to evict "
    "from its full prefix cache to store the blocks it computes (prefill) or pulls (decode), "
    "by role (cache-aware)", ["policy", "role"],
    buckets=BLOCK_BUCKETS, registry=REGISTRY)
PICK_TRANSFER_SECONDS = Histogram(
    "kvbridge_router_pick_transfer_estimate_seconds", "The chosen pair's estimated KV pull "
    "time (bytes the decode lacks over its transport's throughput)", ["policy"],
    buckets=(0.00001, 0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1), registry=REGISTRY)
PICK_QUEUE = Histogram(
    "kvbridge_router_pick_queue", "Requests ahead at the chosen prefill and decode together",
    ["policy"], buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128), registry=REGISTRY)
TOKENIZE_FAILURES = Counter(
    "kvbridge_router_tokenize_failures", "Prompts the engines' /tokenize did not turn into "
    "token ids (precise cache tracking): chosen on load alone", registry=REGISTRY)
KV_EVENT_BLOCKS = Counter(
    "kvbridge_router_kv_event_blocks", "Blocks in the engines' KV events, by what the index "
    "did (stored, removed; orphaned: stored under a parent it never saw, not indexed)",
    ["action"], registry=REGISTRY)
KV_EVENT_ENGINES = Gauge(
    "kvbridge_router_kv_event_engines", "Engines whose KV events this front follows (precise "
    "cache tracking)", registry=REGISTRY)
KV_EVENT_ERRORS = Counter(
    "kvbridge_router_kv_event_errors", "KV event batches that made the index forget an "
    "engine's blocks (malformed; gap: a missed sequence number)", ["kind"], registry=REGISTRY)


def observe_decision(decision: Decision) -> None:
    policy = decision.policy
    PICK_PROMPT_BLOCKS.labels(policy).observe(decision.prompt_blocks)
    PICK_HIT_BLOCKS.labels(policy, "prefill").observe(decision.prefill_hit_blocks)
    PICK_HIT_BLOCKS.labels(policy, "decode").observe(decision.decode_hit_blocks)
    PICK_EVICTED_BLOCKS.labels(policy, "prefill").observe(decision.evict_blocks)
    PICK_EVICTED_BLOCKS.labels(policy, "decode").observe(decision.decode_evict_blocks)
    PICK_TRANSFER_SECONDS.labels(policy).observe(decision.transfer_ms / 1000)
    PICK_QUEUE.labels(policy).observe(decision.queue)
