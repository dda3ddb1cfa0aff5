"""The cache-aware pair chooser, pure: prefix keys, the prefix index fed by vLLM's KV events
or by routing, the engines' reported load, and the score with its balance guard."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_router import kv_events, prompts
from kvbridge_router.__main__ import parse_args
from kvbridge_router.balance import Balancer, ChooserSettings, EngineLoad, Prompt
from kvbridge_router.engine_load import parse_load
from kvbridge_router.prefix import PrefixIndex, text_block_keys, token_block_keys
from kvbridge_router.table import Engine, RoutingTable

BS = 4
BLOCK_BYTES = 1000


def engine(eid: str, role: str) -> Engine:
    return Engine(eid, role, f"10.0.0.{len(eid)}", (eid,), 8000, BS, BLOCK_BYTES, 64)


def table(pairs: dict[str, tuple[str, ...]], transports: dict[tuple[str, str], str] | None = None
          ) -> RoutingTable:  # fmt: skip
    ids = set(pairs) | {p for ps in pairs.values() for p in ps}
    engines = {e: engine(e, "decode" if e.startswith("d") else "prefill") for e in ids}
    return RoutingTable(pairs, engines, transports=transports or {})


def prompt_of(tokens: list[int]) -> Prompt:
    return Prompt(tuple(token_block_keys(tokens, BS)), -(-len(tokens) // BS))


def stored(index: PrefixIndex, eid: str, tokens: list[int], salt: str = "h") -> None:
    """What vLLM's events say when ``eid`` caches ``tokens``: one BlockStored per block,
    each naming its parent by vLLM's (opaque) hash."""
    parent = None
    for i in range(len(tokens) // BS):
        vllm_hash = f"{salt}{i}".encode()
        index.observe_stored(eid, [vllm_hash], parent, tokens[i * BS:(i + 1) * BS], BS)
        parent = vllm_hash


CHOOSER = ChooserSettings("cache-aware", prefill_ms_per_block=1.0, queue_ms=10.0)
PROMPT = list(range(100, 140))       # 10 blocks


# -- prefix keys and the index -------------------------------------------------------------
def test_keys_name_whole_prefixes() -> None:
    a = token_block_keys(PROMPT, BS)
    b = token_block_keys([*PROMPT[:20], 7, *PROMPT[21:]], BS)
    assert len(a) == 10 and a[:5] == b[:5] and not set(a[5:]) & set(b[5:])
    assert token_block_keys(PROMPT[:7], BS) == a[:1]           # no key for a partial block
    assert token_block_keys(PROMPT, BS, extra_keys=[("lora",)] * 10) != a


def test_text_keys_share_the_common_prefix() -> None:
    a, b = text_block_keys("x" * 64 + "tenant one", 16), text_block_keys("x" * 64 + "tenant 2", 16)
    assert a[:4] == b[:4] and len(a) == 4


def test_events_index_blocks_and_forget_them() -> None:
    index = PrefixIndex()
    stored(index, "p0", PROMPT)
    keys = token_block_keys(PROMPT, BS)
    assert index.held("p0", keys) == 10 and index.held("p1", keys) == 0
    index.observe_removed("p0", [b"h6"])                        # a middle block evicted
    assert index.held("p0", keys) == 6
    index.observe_cleared("p0")
    assert index.held("p0", keys) == 0 and index.blocks("p0") == 0


def test_a_block_whose_parent_was_missed_is_not_claimed() -> None:
    index = PrefixIndex()
    assert index.observe_stored("p0", [b"x5"], b"never-seen", PROMPT[20:24], BS) == 0
    assert index.blocks("p0") == 0


def test_one_event_with_several_blocks_chains_them() -> None:
    index = PrefixIndex()
    assert index.observe_stored("d0", [b"a", b"b", b"c"], None, PROMPT[:12], BS) == 3
    assert index.held("d0", token_block_keys(PROMPT, BS)) == 3


def test_approximate_record_keeps_the_most_recent_up_to_capacity() -> None:
    index = PrefixIndex()
    first, second = token_block_keys(PROMPT, BS), token_block_keys(list(range(40)), BS)
    index.record("p0", first, capacity=12)
    index.record("p0", second, capacity=12)
    # the older prompt lost its tail first: its head is what other prompts share
    assert index.held("p0", second) == 10 and index.held("p0", first) == 2
    index.record("p0", first * 2, capacity=5)
    assert index.held("p0", first) == 5


def test_a_prompt_just_sent_is_expected_until_its_events_come() -> None:
    """Precise tracking learns of blocks only after an engine computed them; meanwhile the
    prompt counts as held where it was sent, for a while, so its prefix is not computed
    twice by requests right behind it."""
    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    keys = token_block_keys(PROMPT, BS)
    index.expect("p0", keys, seconds=15)
    assert index.held("p0", keys) == 10 and index.held("p1", keys) == 0
    now[0] += 14
    assert index.held("p0", [*keys[:4], 999]) == 4
    now[0] += 2                                          # lapsed: only events count now
    assert index.held("p0", keys) == 0
    index.expect("p0", keys, seconds=15)
    index.observe_cleared("p0")                          # the engine restarted or was reset
    assert index.held("p0", keys) == 0


def test_an_expectation_ends_when_the_engines_events_speak() -> None:
    """Once an engine's events stored or removed a block, they alone say whether it is held:
    an expectation renewed by every request must not hide the eviction of a prefix."""
    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    keys = token_block_keys(PROMPT, BS)
    index.expect("p0", keys, seconds=15)
    stored(index, "p0", PROMPT[:16])                     # 4 blocks stored, 6 still expected
    assert index.held("p0", keys) == 10
    index.observe_removed("p0", [b"h0"])                 # the first block evicted
    assert index.held("p0", keys) == 0
    stored(index, "p0", PROMPT[:16], salt="again")       # computed again
    index.expect("p0", keys, seconds=15)                 # and asked for again
    index.observe_removed("p0", [b"again2", b"h2"])      # its third block evicted
    assert index.held("p0", keys) == 2


# -- vLLM's event batches -------------------------------------------------------------------
def batch(*events: dict[str, object]) -> bytes:
    """A batch as vLLM's ZMQ publisher encodes it (msgspec: array-like batch, tagged maps)."""
    return msgspec.msgpack.encode([1733400000.5, list(events), None])


def test_a_batch_of_vllm_events_applies_to_the_index() -> None:
    index = PrefixIndex()
    events = kv_events.decode_batch(batch(
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": PROMPT[:8], "block_size": BS, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [None, None]},
        {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": 99,
         "token_ids": PROMPT[8:12], "block_size": BS, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}))
    applied = kv_events.apply(index, "d0", events)
    assert (applied.stored, applied.orphaned, applied.removed) == (2, 1, 1)
    assert index.held("d0", token_block_keys(PROMPT, BS)) == 1
    kv_events.apply(index, "d0", kv_events.decode_batch(batch({"type": "AllBlocksCleared"})))
    assert index.blocks("d0") == 0


@pytest.mark.parametrize(("payload", "message"), [
    (b"\xc1", "not msgpack"),
    (msgspec.msgpack.encode({"ts": 1}), "expected [ts, events"),
    (batch({"kind": "BlockStored"}), "a map with a 'type'"),
    (batch({"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 4}),
     "BlockStored.token_ids: expected 4 tokens for 1 blocks of 4, got 1"),
    (batch({"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}),
     "BlockStored.block_size: expected an integer >= 1"),
    (batch({"type": "BlockRemoved", "block_hashes": 5}), "BlockRemoved.block_hashes"),
])
def test_malformed_batches_name_what_is_wrong(payload: bytes, message: str) -> None:
    with pytest.raises(kv_events.EventError, match=message.replace("[", r"\[")):
        kv_events.decode_batch(payload)


def test_sequence_numbers() -> None:
    assert kv_events.sequence_number((41).to_bytes(8, "big")) == 41
    with pytest.raises(kv_events.EventError, match="expected 8 bytes, got 2"):
        kv_events.sequence_number(b"\x00\x01")


# -- engines' own load ----------------------------------------------------------------------
def test_load_from_vllm_metrics() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0 1733400000000
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running_total{engine="0"} 99.0
"""
    assert parse_load(text) == EngineLoad(3, 3, 0.25)
    assert parse_load("# nothing of vLLM's\nother 1\n") is None


# -- prompts --------------------------------------------------------------------------------
def test_prompts_tokenize_requests_and_text() -> None:
    parts = [{"type": "text", "text": "hi"}]
    chat = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": parts}],
            "max_tokens": 3, "add_generation_prompt": True}  # fmt: skip
    assert prompts.tokenize_request(chat) == {
        "model": "m", "messages": chat["messages"], "add_generation_prompt": True}
    assert prompts.prompt_text(chat) == "<system>be brief<user>hi"
    assert prompts.tokenize_request({"prompt": "abc", "max_tokens": 1}) == {"prompt": "abc"}
    assert prompts.token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompts.token_ids({"prompt": "abc"}) is None
    assert prompts.tokenize_request({"prompt": [1, 2]}) is None


# -- the choice -----------------------------------------------------------------------------
def test_the_pair_that_holds_the_prefix_wins_on_both_sides() -> None:
    t = table({"d0": ("p0", "p1"), "d1": ("p0", "p1")})
    b = Balancer(CHOOSER)
    stored(b.index, "p1", PROMPT)
    stored(b.index, "d1", PROMPT[:24])
    decision = b.decide(t, prompt=prompt_of([*PROMPT, 1, 2]))
    assert decision is not None and decision.pair.label == "p1->d1"
    assert (decision.prefill_hit_blocks, decision.decode_hit_blocks) == (10, 6)
    assert decision.prompt_blocks == 11 and decision.pull_bytes == 5 * BLOCK_BYTES


def test_load_outweighs_a_small_hit_not_a_large_one() -> None:
    t = table({"d0": ("p0", "p1")})
    b = Balancer(CHOOSER)
    stored(b.index, "p1", PROMPT[:8])                  # 2 blocks: 2 ms saved
    b.outstanding["p1"] = 1                             # 10 ms of queue
    assert b.pick(t, prompt=prompt_of(PROMPT)).prefill.engine_id == "p0"
    stored(b.index, "p1", PROMPT)                       # 10 blocks: 10 ms saved ...
    b.loads["p0"] = EngineLoad(running=0, waiting=1)    # ... and p0 reports a queue too
    assert b.pick(t, prompt=prompt_of(PROMPT)).prefill.engine_id == "p1"


def test_an_engines_report_counts_other_fronts_requests_not_ours_twice() -> None:
    t = table({"d0": ("p0",)})
    b = Balancer(CHOOSER)
    p0 = t.engines["p0"]
    b.outstanding["p0"] = 2
    b.loads["p0"] = EngineLoad(running=5, waiting=1, ours=2)   # 4 from other routers
    assert b.queue(p0) == 6
    b.done(p0)
    b.done(p0)                                                  # ours finished since
    assert b.queue(p0) == 4
    b.loads["p0"] = EngineLoad(running=1, ours=1)               # a stale report of ours
    assert b.queue(p0) == 0


def test_a_prefills_wait_is_its_work_not_its_request_count() -> None:
    """Three requests whose prefix p1 holds (a block each to compute) wait less than one
    cold request at p0 (ten blocks): the next cold prompt goes to p1."""
    t = table({"d0": ("p0", "p1")})
    b = Balancer(ChooserSettings("cache-aware", prefill_ms_per_block=5.0, queue_ms=1.0))
    b.start(t.engines["p0"], blocks=10)
    for _ in range(3):
        b.start(t.engines["p1"], blocks=1)
    decision = b.decide(t, prompt=prompt_of(list(range(500, 540))))
    assert decision.pair.prefill.engine_id == "p1" and decision.pair.prefill_blocks == 10
    assert b.work == {"p0": 10, "p1": 3}
    b.done(t.engines["p0"], blocks=10)
    assert b.work == {"p1": 3} and b.outstanding["p0"] == 0


def test_the_guard_leaves_room_above_a_small_mean() -> None:
    """One request in flight at the prefill that holds the prefix and none at the other:
    the next request with that prefix still goes where the prefix is."""
    t = table({"d0": ("p0", "p1")})
    b = Balancer(ChooserSettings("cache-aware", prefill_ms_per_block=5.0))
    stored(b.index, "p0", PROMPT)
    b.start(t.engines["p0"])
    assert b.pick(t, prompt=prompt_of(PROMPT)).prefill.engine_id == "p0"
    strict = Balancer(ChooserSettings("cache-aware", prefill_ms_per_block=5.0,
                                      balance_slack=0), b.index, {}, b.outstanding.copy())
    assert strict.pick(t, prompt=prompt_of(PROMPT)).prefill.engine_id == "p1"


def fill(index: PrefixIndex, eid: str, blocks: int) -> None:
    """``eid`` caches ``blocks`` blocks of prompts no test asks for."""
    stored(index, eid, list(range(10_000, 10_000 + blocks * BS)), salt=f"{eid}-other")


def test_evicting_from_a_full_prefill_costs_what_it_will_recompute() -> None:
    """p0 holds the prompt but has a request in flight; p1's cache is full. Computing the
    prompt at p1 would be quicker than waiting at p0 if evictions were free, but each block
    p1 stores evicts one a later prompt computes again: the prompt stays at p0."""
    t = table({"d0": ("p0", "p1")})
    b = Balancer(CHOOSER)
    stored(b.index, "p0", PROMPT)
    fill(b.index, "p1", 64)                              # its whole pool (engine(): 64)
    b.start(t.engines["p0"], blocks=3)                   # 3 + 10 ms of wait at p0
    decision = b.decide(t, prompt=prompt_of(PROMPT))
    assert decision.pair.prefill.engine_id == "p0" and decision.evict_blocks == 0
    free = Balancer(ChooserSettings("cache-aware", prefill_ms_per_block=1.0, queue_ms=10.0,
                                    eviction_weight=0), b.index, {}, b.outstanding.copy(),
                    b.work.copy())  # fmt: skip
    spilled = free.decide(t, prompt=prompt_of(PROMPT))
    assert spilled.pair.prefill.engine_id == "p1" and spilled.evict_blocks == 10
    assert "evicting 10 and 0" in spilled.describe()


def test_a_full_decode_counts_the_pulls_its_evictions_will_cause() -> None:
    """d0 holds the prompt but has two more requests in flight than d1, whose cache is
    full: with evictions free the queue sends the prompt to d1; counted, it stays at d0."""
    t = table({"d0": ("p0",), "d1": ("p0",)})
    settings_ = ChooserSettings("cache-aware", pull_ms_per_block=1.0, decode_queue_ms=6.0,
                                transport_gbps={"tcp": 1e9})  # fmt: skip
    b = Balancer(settings_)
    stored(b.index, "d0", PROMPT)
    fill(b.index, "d1", 64)
    b.outstanding["d0"] = 2                              # 12 ms against 10 blocks' pull
    decision = b.decide(t, prompt=prompt_of(PROMPT))
    assert decision.pair.decode.engine_id == "d0" and decision.decode_evict_blocks == 0
    free = Balancer(replace(settings_, eviction_weight=0), b.index, {}, b.outstanding.copy())
    moved = free.decide(t, prompt=prompt_of(PROMPT))
    assert moved.pair.decode.engine_id == "d1" and moved.decode_evict_blocks == 10


def test_a_new_prefix_goes_where_there_is_room() -> None:
    """A prompt nobody holds goes to the prefill with free room in its cache, counting the
    blocks its requests in flight are about to store."""
    t = table({"d0": ("p0", "p1")})
    b = Balancer(CHOOSER)
    fill(b.index, "p0", 60)
    fill(b.index, "p1", 30)
    p0, p1 = t.engines["p0"], t.engines["p1"]
    assert (b.evictions(p0, 10), b.evictions(p1, 10)) == (6, 0)
    assert b.pick(t, prompt=prompt_of(PROMPT)).prefill.engine_id == "p1"
    b.start(p1, blocks=30)                               # p1's room is spoken for
    assert b.evictions(p1, 10) == 6
    assert b.evictions(Engine("px", "prefill", "h", ("px",)), 10) == 0   # pool size unknown


def test_a_deferred_prompt_counts_as_all_work_where_it_goes() -> None:
    """A prompt chosen before its tokens are known (its opening never seen) can be held
    nowhere: all of its blocks are work at the prefill it goes to, and room decides."""
    t = table({"d0": ("p0", "p1")})
    b = Balancer(CHOOSER)
    fill(b.index, "p0", 64)
    cold = Prompt((), 12, deferred={"prompt": "..."})
    decision = b.decide(t, prompt=cold)
    assert decision.pair.prefill.engine_id == "p1" and decision.pair.prefill_blocks == 12
    assert (decision.prefill_hit_blocks, decision.decode_hit_blocks) == (0, 0)


def test_a_faster_transport_wins_when_the_rest_is_equal() -> None:
    t = table({"d0": ("p0", "p1")}, {("d0", "p0"): "tcp", ("d0", "p1"): "rc_mlx5"})
    settings_ = ChooserSettings("cache-aware", transport_gbps={"tcp": 1.0, "rc": 20.0})
    decision = Balancer(settings_).decide(t, prompt=prompt_of(PROMPT))
    assert decision.pair.prefill.engine_id == "p1"
    assert decision.transfer_ms == pytest.approx(10 * BLOCK_BYTES / 20e6 + 10 * 0.1)
    assert settings_.gbps("cma+tcp") == 1.0 and settings_.gbps("") == 1.0


def test_the_balance_guard_stops_a_hot_prefix_piling_up() -> None:
    t = table({"d0": ("p0", "p1")})
    b = Balancer(CHOOSER)
    stored(b.index, "p0", PROMPT)
    chosen = []
    for _ in range(12):
        pair = b.pick(t, prompt=prompt_of(PROMPT))
        b.start(pair.prefill)
        chosen.append(pair.prefill.engine_id)
    assert chosen[0] == "p0"
    counts = {e: chosen.count(e) for e in ("p0", "p1")}
    mean = sum(counts.values()) / 2
    assert max(counts.values()) <= 1.5 * mean + 1, counts


def test_pairs_that_lost_verification_are_never_chosen_whatever_they_hold() -> None:
    b = Balancer(CHOOSER)
    stored(b.index, "p1", PROMPT)
    stored(b.index, "d1", PROMPT)
    before = table({"d0": ("p0",), "d1": ("p1",)})
    assert b.pick(before, prompt=prompt_of(PROMPT)).label == "p1->d1"
    after = table({"d0": ("p0",)})                      # d1 lost its pair; events keep coming
    stored(b.index, "d1", PROMPT, salt="again")
    assert b.pick(after, prompt=prompt_of(PROMPT)).label == "p0->d0"
    assert b.pick(before, avoid={("d1", "p1")}, prompt=prompt_of(PROMPT)).label == "p0->d0"
    assert b.pick(RoutingTable(), prompt=prompt_of(PROMPT)) is None


def test_least_load_stays_as_it_was() -> None:
    t = table({"d0": ("p0",), "d1": ("p0",)})
    b = Balancer()
    stored(b.index, "d1", PROMPT)
    b.outstanding["d1"] = 1
    assert b.pick(t, prompt=prompt_of(PROMPT)).decode.engine_id == "d0"
    assert b.decide(t).policy == "least-load"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_choice_is_a_verified_pair_within_the_guard(data: st.DataObject) -> None:
    n_d, n_p = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    pairs = {f"d{i}": tuple(f"p{j}" for j in range(n_p)
                            if data.draw(st.booleans(), label=f"d{i}p{j}")) for i in range(n_d)}
    pairs = {d: ps for d, ps in pairs.items() if ps}
    t = table(pairs) if pairs else RoutingTable()
    b = Balancer(CHOOSER)
    for e in t.engines:
        b.outstanding[e] = data.draw(st.integers(0, 6), label=f"load {e}")
        if data.draw(st.booleans(), label=f"holds {e}"):
            stored(b.index, e, PROMPT[:data.draw(st.integers(0, 40))])
    avoid = {(d, p) for d, ps in pairs.items() for p in ps
             if data.draw(st.booleans(), label=f"avoid {d}{p}")}  # fmt: skip
    decision = b.decide(t, avoid=avoid, prompt=prompt_of(PROMPT))
    allowed = [(d, p) for d, ps in pairs.items() for p in ps if (d, p) not in avoid]
    if not allowed:
        assert decision is None
        return
    chosen = (decision.pair.decode.engine_id, decision.pair.prefill.engine_id)
    assert chosen in allowed

    def within(e: str, side: int) -> bool:
        peers = {a[side] for a in allowed}
        mean = (sum(b.outstanding[p] for p in peers) + 1) / len(peers)
        load = b.outstanding[e] + 1
        return load <= CHOOSER.balance_factor * mean or load <= mean + CHOOSER.balance_slack

    guarded = [a for a in allowed if within(a[0], 0) and within(a[1], 1)]
    assert not guarded or chosen in guarded, (b.outstanding, chosen, guarded)


# -- settings -------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["--policy", "random"], "--policy: invalid choice"),
    (["--balance-factor", "0.5"], "--balance-factor: expected a number >= 1, got 0.5"),
    (["--queue-ms", "-1"], "--queue-ms: expected a number >= 0, got -1"),
    (["--balance-slack", "-2"], "--balance-slack: expected a number >= 0, got -2"),
    (["--transport-gbps", "tcp=fast"], "--transport-gbps: expected NAME=GBPS"),
    (["--transport-gbps", "tcp=0"], "--transport-gbps: tcp: expected a rate > 0"),
    (["--kv-events-port", "70000"], "--kv-events-port: expected 0 to 65535, got 70000"),
])
def test_bad_settings_name_the_flag(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args(["--transfer", "t", *argv])
    assert message in capsys.readouterr().err


def test_settings_reach_the_router_and_the_picker() -> None:
    args = parse_args(["--transfer", "t", "--policy", "cache-aware", "--kv-events-port", "5557",
                       "--transport-gbps", "tcp=2,cma=8", "--balance-factor", "2"])
    assert args.chooser.policy == "cache-aware" and args.chooser.balance_factor == 2
    assert args.chooser.transport_gbps["tcp"] == 2 and args.chooser.transport_gbps["rc"] == 20
    assert args.tracking.kv_events_port == 5557
    epp = parse_args(["epp", "--transfer", "t", "--policy", "cache-aware"])
    assert epp.chooser.policy == "cache-aware" and epp.tracking.kv_events_port == 0


def test_kv_events_port_from_vllms_config() -> None:
    """The port kvbridge's connector publishes as ``spec.kvEventsPort``: only a bound ZMQ
    endpoint is one a router can subscribe to (vLLM connects when a host is named)."""
    from types import SimpleNamespace

    from kvbridge_agent.vllm._events import kv_events_port

    def config(endpoint: str, enabled: bool = True, publisher: str = "zmq") -> SimpleNamespace:
        return SimpleNamespace(enable_kv_cache_events=enabled, publisher=publisher,
                               endpoint=endpoint)  # fmt: skip

    assert kv_events_port(config("tcp://*:5557")) == 5557
    assert kv_events_port(config("tcp://*:5557"), dp_index=2) == 5559
    assert kv_events_port(config("tcp://[::]:6000")) == 6000
    assert kv_events_port(config("tcp://10.1.2.3:5557")) == 0     # vLLM connects out
    assert kv_events_port(config("ipc:///tmp/events")) == 0
    assert kv_events_port(config("tcp://*:5557", enabled=False)) == 0
    assert kv_events_port(config("tcp://*:5557", publisher="null")) == 0
    assert kv_events_port(None) == 0


def test_every_policy_has_its_decision_series_from_the_start() -> None:
    from prometheus_client import generate_latest

    from kvbridge_router import metrics as m
    from kvbridge_router.balance import POLICIES

    m.init_series()
    text = generate_latest(m.REGISTRY).decode()
    for policy in POLICIES:
        for role in ("prefill", "decode"):
            for name in ("cache_hit_blocks", "evicted_blocks"):
                assert (f'kvbridge_router_pick_{name}_sum{{policy="{policy}",'
                        f'role="{role}"}}') in text
        assert f'kvbridge_router_pick_prompt_blocks_sum{{policy="{policy}"}}' in text


def test_a_decision_records_what_it_would_evict_on_each_side() -> None:
    from kvbridge_router import metrics as m

    def evicted(role: str) -> float:
        value = m.REGISTRY.get_sample_value("kvbridge_router_pick_evicted_blocks_sum",
                                            {"policy": "cache-aware", "role": role})
        return value or 0.0

    t = table({"d0": ("p0",)})
    b = Balancer(CHOOSER)
    fill(b.index, "p0", 60)
    fill(b.index, "d0", 62)
    before = evicted("prefill"), evicted("decode")
    decision = b.decide(t, prompt=prompt_of(PROMPT))
    assert (decision.evict_blocks, decision.decode_evict_blocks) == (6, 8)
    m.observe_decision(decision)
    assert (evicted("prefill") - before[0], evicted("decode") - before[1]) == (6, 8)
