"""KVBridgeConnector inside real vLLM 0.30.0 engines, against vLLM's own NIXL connector.

Per model (a 2-layer Llama: one KV cache group; a Llama alternating sliding-window and full
attention: two groups, so grouped transfers run inside vLLM; a DeepSeek-V2-style MLA model on
vLLM's CPU MLA backend: replicated latent caches, block size 16) five engines run as separate
processes: a reference engine without a connector, a stock and a kvbridge prefill, a stock
and a kvbridge decode. In all four pairings (stock->stock, the control; kvbridge->kvbridge;
stock->kvbridge; kvbridge->stock) the decode engine's greedy tokens must equal the reference
engine's, token for token, for a prompt shorter than a block, a prompt of many blocks and one
whose prefix the decode engine already holds, and the decode's received blocks must equal
the prefill's, byte for byte, read through the registered KV tensors. The weights are seeded
random (not vLLM's dummy loader), so wrong KV changes the tokens (see test_vllm_control).

MLA is held to vLLM, not to one engine: on vLLM 0.30.0's CPU MLA backend a decode engine
fed by vLLM's own connector on both sides already gives other greedy tokens than a single
engine (its first decoded token differs; deterministically, run after run), so on CPU MLA
the single engine is not the reference. There, every pairing's tokens must equal those of a
control pair made of vLLM's connector on both sides (a sixth engine, a second stock decode,
fed the same prompts in the same order), and the received blocks must equal the prefill's
byte for byte as on the other models. The prompt shorter than a block is left out on MLA:
the control pair's tokens for it change from run to run (no block is transferred for it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_testkit.vllm_harness import (
    MAX_TOKENS,
    PAIRINGS,
    EngineProcess,
    aligned_full_blocks,
    assert_pulled_right,
    block_digests,
    pd_generate,
    prompts_for,
    running,
    write_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.nixl, pytest.mark.vllm]



@pytest.fixture(scope="module", params=["llama", "hybrid", "mla"])
def engines(request: pytest.FixtureRequest, vllm_py: str, engine_logs: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The five engines of one model; kvbridge engines run as ``kv_both`` on the hybrid
    model (docs/connector.md's one-flag configuration) and as producer/consumer on the Llama."""
    kind = request.param
    model = write_model(tmp_path_factory.mktemp(kind) / "model", kind=kind, seed=3)
    kvb_p, kvb_d = ("kv_both", "kv_both") if kind == "hybrid" else ("kv_producer",
                                                                    "kv_consumer")

    def engine(name: str, connector: str, role: str) -> EngineProcess:
        return EngineProcess(model, engine_logs, connector=connector, kv_role=role,
                             engine_id=f"{kind}-{name}", name=f"{kind}-{name}",
                             load_failure_policy="fail")

    made = {
        "ref": engine("ref", "none", "kv_both"),
        **({"control": engine("d-control", "stock", "kv_consumer")} if kind == "mla" else {}),
        ("prefill", "stock"): engine("p-stock", "stock", "kv_producer"),
        ("prefill", "kvbridge"): engine("p-kvb", "kvbridge", kvb_p),
        ("decode", "stock"): engine("d-stock", "stock", "kv_consumer"),
        ("decode", "kvbridge"): engine("d-kvb", "kvbridge", kvb_d),
    }
    with running(made):
        yield {"kind": kind, **made}


@pytest.mark.parametrize("pairing", PAIRINGS, ids=["->".join(p) for p in PAIRINGS])
def test_pd_tokens_and_bytes_equal_one_engine(engines: dict[str, Any],
                                              pairing: tuple[str, str]) -> None:
    p_kind, d_kind = pairing
    prefill, decode = engines[("prefill", p_kind)], engines[("decode", d_kind)]
    seed = 1000 * PAIRINGS.index(pairing) + (7 if engines["kind"] == "hybrid" else 0)
    short, long, shared = prompts_for(seed)
    firsts = [long] if engines["kind"] == "mla" else [short, long]   # see module docstring
    if engines["kind"] == "mla":
        control = [engines[("prefill", "stock")], engines["control"]]
        reference = [o.token_ids for o in (*pd_generate(*control, firsts, MAX_TOKENS),
                                           *pd_generate(*control, [shared], MAX_TOKENS))]
    else:
        reference = [o["token_ids"] for o in engines["ref"].generate([*firsts, shared],
                                                                     MAX_TOKENS)]
    decode.call({"cmd": "transfers"})   # forget earlier pairings' records

    # The shared-prefix prompt goes after the long one, so the decode holds its prefix.
    first = pd_generate(prefill, decode, firsts, MAX_TOKENS)
    loads = decode.call({"cmd": "transfers"})["transfers"]
    for remote in [r for r in loads if not r["failed"]]:
        local_ids, remote_ids = aligned_full_blocks(remote["local_block_ids"],
                                                    remote["remote_block_ids"])
        if any(local_ids):
            assert block_digests(decode, local_ids) == block_digests(prefill, remote_ids), (
                f"{pairing}: received KV differs from the prefill's blocks", remote)
    second = pd_generate(prefill, decode, [shared], MAX_TOKENS)
    loads += decode.call({"cmd": "transfers"})["transfers"]

    assert_pulled_right(f"{engines['kind']} {pairing}", decode, [*first, *second], reference,
                        loads)
    if engines["kind"] == "llama":
        # The decode kept the long prompt's blocks: the shared prompt pulled only the rest.
        last = loads[-1]
        assert 0 < len(last["local_block_ids"][0]) < len(last["remote_block_ids"][0]), last
