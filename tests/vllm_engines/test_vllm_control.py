"""The engine-level tests can tell right KV from wrong: the model has seeded random weights,
so greedy tokens depend on the whole context, not only on the last token (as they do with
vLLM's dummy weights), and a decode engine that received wrong KV would diverge. The control
pairing itself (vLLM's own connector on both sides) is in test_vllm_connector.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvbridge_testkit.vllm_harness import EngineProcess

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_TOKENS = 8
BLOCK = 32


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Ids 0-2 are the config's special tokens; keep prompts to ordinary ones.
    return [rng.randrange(3, 512) for _ in range(n)]


RNG = random.Random(20261202)
SHORT = _tokens(RNG, 10)                    # shorter than one block
LONG = _tokens(RNG, 200)                    # six full blocks and a partial one
SHARED = LONG[: 5 * BLOCK] + _tokens(RNG, 45)  # five blocks in common with LONG
PROMPTS = {"short": SHORT, "long": LONG, "shared": SHARED}
# Same last token, different contexts: outputs must differ, or wrong KV would go unnoticed.
SAME_LAST = [[*_tokens(RNG, 40), 77], [*_tokens(RNG, 40), 77]]


@pytest.fixture(scope="module")
def reference(llama_model: Path, engine_logs: Path) -> dict[str, list[int]]:
    """Greedy tokens from one engine without a connector, prompts sent one at a time in the
    same order as the prefill/decode run (so prefix-cache hits happen alike)."""
    with EngineProcess(llama_model, engine_logs, connector="none", name="single") as single:
        out = {name: single.generate([p], MAX_TOKENS)[0]["token_ids"]
               for name, p in PROMPTS.items()}
        same_last = single.generate(SAME_LAST, MAX_TOKENS)
        out.update({f"same_last_{i}": o["token_ids"] for i, o in enumerate(same_last)})
    return out


def test_outputs_depend_on_context(reference: dict[str, list[int]]) -> None:
    assert reference["same_last_0"] != reference["same_last_1"], (
        "two prompts with the same last token gave the same greedy tokens: the model ignores "
        "its context, so a KV transfer delivering wrong blocks would still match"
    )
    assert len({tuple(reference[n]) for n in PROMPTS}) == len(PROMPTS)
