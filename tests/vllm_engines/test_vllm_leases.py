"""Lease deadlines in real vLLM engines: a decode that reads after the prefill's lease ran
out must never answer with tokens computed from freed, reused blocks.

A kvbridge prefill states its deadline (``remote_blocks_expiry_time``) and a kvbridge decode
declines a read that cannot start ``kvbridge_lease_margin_s`` before it; the request then
follows ``kv_load_failure_policy``. Stock vLLM 0.30.0 has no such check in pull mode: the
baseline (stock to stock) reads the reused blocks and reports success with other tokens,
and so does every mixed pairing (a stock prefill states no deadline; a stock decode ignores
it). The prefill engines here have a 6 s lease and a pool of 40 blocks, so that one 1,000-
token prompt reuses most of it. The harness's engines step only inside a command, so a
prefill frees an expired request's blocks at its next ``generate``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_testkit.vllm_harness import EngineProcess, RandomPrompts, received_ok, running

pytestmark = [pytest.mark.slow, pytest.mark.nixl, pytest.mark.vllm]

LEASE_S = 6
MARGIN_S = 1.0
NUM_BLOCKS = 40
MAX_TOKENS = 6
PREFILL = {"kv_lease_duration": LEASE_S}
DECODE = {"kv_lease_duration": LEASE_S, "kvbridge_lease_margin_s": MARGIN_S,
          "kvbridge_transfer_timeout_s": 10}


@pytest.fixture(scope="module")
def engines(vllm_py: str, engine_logs: Path, llama_model: Path) -> Iterator[dict[str, Any]]:
    def engine(name: str, connector: str, kv_role: str, policy: str = "recompute"
               ) -> EngineProcess:  # fmt: skip
        extra = PREFILL if kv_role == "kv_producer" else DECODE
        return EngineProcess(llama_model, engine_logs, connector=connector, kv_role=kv_role,
                             engine_id=f"l-{name}", name=f"l-{name}",
                             load_failure_policy=policy, num_blocks=NUM_BLOCKS,
                             extra_config=extra)

    made: dict[str, Any] = {
        "ref": EngineProcess(llama_model, engine_logs, name="l-ref"),
        "p-kvbridge": engine("p-kvbridge", "kvbridge", "kv_producer"),
        "p-stock": engine("p-stock", "stock", "kv_producer"),
        "d-kvbridge": engine("d-kvbridge", "kvbridge", "kv_consumer"),
        "d-kvbridge-fail": engine("d-kvbridge-fail", "kvbridge", "kv_consumer", "fail"),
        "d-stock": engine("d-stock", "stock", "kv_consumer"),
    }
    with running(made):
        yield made


def reference(engines: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    return [o["token_ids"] for o in engines["ref"].generate(prompts, MAX_TOKENS)]


def hand_out(prefill: EngineProcess, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Prefill ``prompts``; the decode requests' ``kv_transfer_params``."""
    outs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    return [{**o["kv_transfer_params"], "do_remote_prefill": True, "do_remote_decode": False}
            for o in outs]


def reuse_pool(prefill: EngineProcess, prompt: RandomPrompts) -> None:
    """Expired leases are freed at the first step; three 1,000-token prompts (32 blocks
    each, of 40) then overwrite the freed blocks."""
    for _ in range(3):
        prefill.generate([prompt(1000)], 1)


def declined(decode: EngineProcess) -> float:
    return float(decode.call({"cmd": "connector_state"})["late_reads_declined"])



def late_read(engines: dict[str, Any], prefill: str, decode: str, prompt: RandomPrompts
              ) -> tuple[dict[str, Any], list[int]]:  # fmt: skip
    """A decode request that arrives after the lease ran out and the pool was reused."""
    p = prompt()
    params = hand_out(engines[prefill], [p])
    time.sleep(LEASE_S + 0.5)
    reuse_pool(engines[prefill], prompt)
    out = engines[decode].generate([p], MAX_TOKENS, params)[0]
    return out, reference(engines, [p])[0]


def test_kvbridge_prefill_states_its_deadline(engines: dict[str, Any]) -> None:
    before = time.perf_counter()
    params = hand_out(engines["p-kvbridge"], [RandomPrompts(1)()])[0]
    after = time.perf_counter()
    # The harness's processes share this host's CLOCK_MONOTONIC (perf_counter).
    assert before + LEASE_S <= params["remote_blocks_expiry_time"] <= after + LEASE_S
    assert params["kvbridge_lease_extension_s"] == pytest.approx(LEASE_S * 2 / 3)
    stock = hand_out(engines["p-stock"], [RandomPrompts(2)()])[0]
    assert stock["remote_blocks_expiry_time"] is None, "stock vLLM 0.30.0 states none"


def test_late_read_after_pool_reuse(engines: dict[str, Any]) -> None:
    prompt = RandomPrompts(11)
    # The hazard, stock to stock: the decode reads reused blocks and reports success.
    out, ref = late_read(engines, "p-stock", "d-stock", prompt)
    stock_wrong = out["token_ids"] != ref
    assert out["finish_reason"] == "length"
    assert stock_wrong, "precondition: the pool was reused, so stock vLLM answers wrongly"

    # kvbridge to kvbridge, recompute: the read is declined, the tokens are right.
    n = declined(engines["d-kvbridge"])
    out, ref = late_read(engines, "p-kvbridge", "d-kvbridge", prompt)
    assert out["token_ids"] == ref, "recompute after a declined read: one engine's tokens"
    assert received_ok(engines["d-kvbridge"]) == [False]
    assert declined(engines["d-kvbridge"]) == n + 1

    # kvbridge to kvbridge, fail: a clean error, never tokens.
    n = declined(engines["d-kvbridge-fail"])
    out, ref = late_read(engines, "p-kvbridge", "d-kvbridge-fail", prompt)
    assert out["finish_reason"] not in ("length", "stop") and \
        len(out["token_ids"]) < MAX_TOKENS, f"fail policy: an error, not tokens: {out}"
    assert received_ok(engines["d-kvbridge-fail"]) == [False]
    assert declined(engines["d-kvbridge-fail"]) == n + 1

    # Mixed pairings behave as stock vLLM does: nothing to check against, or no check.
    n = declined(engines["d-kvbridge"])
    for prefill, decode in (("p-stock", "d-kvbridge"), ("p-kvbridge", "d-stock")):
        out, ref = late_read(engines, prefill, decode, prompt)
        print(f"{prefill} -> {decode}: late read answered "
              f"{'wrong' if out['token_ids'] != ref else 'right'} tokens (stock to stock: "
              f"{'wrong' if stock_wrong else 'right'})")
        assert (out["token_ids"] != ref) == stock_wrong, f"{prefill} -> {decode}"
    assert declined(engines["d-kvbridge"]) == n, "a stock prefill states no deadline"


def test_read_just_inside_the_lease_pulls_and_just_outside_declines(
        engines: dict[str, Any]) -> None:
    prompt, decode = RandomPrompts(21), engines["d-kvbridge"]
    received_ok(decode)   # forget earlier tests' receives
    n = declined(decode)
    # 3 s of the 6 s lease left when the request is sent: above the 1 s margin.
    p = prompt()
    params = hand_out(engines["p-kvbridge"], [p])
    sent_at = params[0]["remote_blocks_expiry_time"] - 3.0
    time.sleep(max(0.0, sent_at - time.perf_counter()))
    out = decode.generate([p], MAX_TOKENS, params)[0]
    assert out["token_ids"] == reference(engines, [p])[0]
    assert received_ok(decode) == [True], "a read inside the lease is not refused"
    assert declined(decode) == n
    # 0.5 s left: under the margin, declined although the idle prefill still holds them.
    p = prompt()
    params = hand_out(engines["p-kvbridge"], [p])
    time.sleep(max(0.0, params[0]["remote_blocks_expiry_time"] - 0.5 - time.perf_counter()))
    out = decode.generate([p], MAX_TOKENS, params)[0]
    assert out["token_ids"] == reference(engines, [p])[0]
    assert received_ok(decode) == [False]
    assert declined(decode) == n + 1


def test_overloaded_prefill_never_yields_wrong_tokens(engines: dict[str, Any]) -> None:
    """16 prompts of 5 blocks (80 blocks) on a 40-block prefill: later prompts wait until
    the leases of earlier, unread ones run out, and take their blocks."""
    prompt, decode = RandomPrompts(31), engines["d-kvbridge"]
    prompts = [prompt() for _ in range(16)]
    refs = reference(engines, prompts)
    received_ok(decode)   # forget earlier tests' receives
    n = declined(decode)
    started = time.perf_counter()
    params = hand_out(engines["p-kvbridge"], prompts)
    prefill_s = time.perf_counter() - started
    outs = decode.generate(prompts, MAX_TOKENS, params)
    ok = received_ok(decode)
    wrong = sum(o["token_ids"] != r for o, r in zip(outs, refs, strict=True))
    late = declined(decode) - n
    print(f"overloaded prefill: {prefill_s:.1f} s for 16 prompts; {late:.0f} reads declined, "
          f"{sum(ok)} pulled, {wrong} wrong")
    assert wrong == 0
    assert late >= 1, "the first wave's leases ran out while later prompts waited"
    assert len(ok) == 16 and sum(ok) + late == 16
    # The same load between stock engines, for the record (nothing declines a late read).
    prompts = [prompt() for _ in range(16)]
    refs = reference(engines, prompts)
    outs = engines["d-stock"].generate(prompts, MAX_TOKENS, hand_out(engines["p-stock"], prompts))
    wrong = sum(o["token_ids"] != r for o, r in zip(outs, refs, strict=True))
    print(f"the same between stock engines: {wrong} of 16 answered wrong tokens as a success")
