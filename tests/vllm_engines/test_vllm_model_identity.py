"""Model identity between kvbridge engines in real vLLM engines (issue #35, no operator).

A prefill and a decode serve the same model path, but the weights are rewritten between
the prefill's start and the decode's: both pass vLLM's compatibility hash (same name, same
shapes). The kvbridge decode asks the kvbridge prefill for its identity on the side channel,
sees another fingerprint and declines every read from it, so each request is either
recomputed with the decode's own weights (``kv_load_failure_policy: recompute``) or fails
(``fail``, vLLM's default); none is answered from the other model's KV."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_agent.identity import fingerprint
from kvbridge_testkit.vllm_harness import (
    EngineProcess,
    RandomPrompts,
    received_ok,
    running,
    write_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.nixl, pytest.mark.vllm]

MAX_TOKENS = 6
HERE = Path(__file__).resolve().parent


def test_listener_answers_as_vllms_does(vllm_py: str) -> None:
    """vLLM's listener and kvbridge's, side by side in the vLLM venv (no engine)."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1] / "agent")}
    out = subprocess.run([vllm_py, str(HERE / "listener_vs_vllm.py")], capture_output=True,
                         text=True, timeout=180, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same_payload"] == [True, True] and got["float_timestamps"] == [True, True]
    assert got["identity"] and got["kvbridge_answers_garbage"] and got["kvbridge_alive"]
    # Why only a peer whose params carry the marker is asked: vLLM's listener dies on it.
    assert not got["vllm_answers_identity_request"]
    assert not got["vllm_alive_after_identity_request"]


def rewrite_model(model: Path, seed: int) -> None:
    """Other weights at the same path. Each file is replaced by a rename, so the prefill,
    which may still map the old files, keeps reading the inodes it loaded."""
    fresh = write_model(model.parent / f"seed{seed}", kind="llama", seed=seed)
    for path in fresh.iterdir():
        os.replace(path, model / path.name)


@pytest.fixture(scope="module")
def engines(vllm_py: str, engine_logs: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Any]]:  # fmt: skip
    model = write_model(tmp_path_factory.mktemp("rewritten") / "model", kind="llama", seed=1)
    fingerprints = {"p": fingerprint(model, "sampled").value}
    prefill = EngineProcess(model, engine_logs, connector="kvbridge", kv_role="kv_producer",
                            engine_id="mi-prefill", name="mi-prefill")
    with running({"p": prefill}):
        rewrite_model(model, seed=2)
        fingerprints["d"] = fingerprint(model, "sampled").value
        assert fingerprints["d"] != fingerprints["p"]

        def decode(name: str, **kwargs: Any) -> EngineProcess:
            return EngineProcess(model, engine_logs, connector="kvbridge",
                                 kv_role="kv_consumer", engine_id=f"mi-{name}",
                                 name=f"mi-{name}", **kwargs)

        # kv_load_failure_policy: "fail" (vLLM's default, the harness's too) and "recompute".
        with running({"d-fail": decode("d-fail"),
                      "d-recompute": decode("d-recompute", load_failure_policy="recompute")}
                     ) as decodes:
            yield {"p": prefill, **decodes, "fingerprints": fingerprints}


def hand_out(prefill: EngineProcess, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    return [{**o["kv_transfer_params"], "do_remote_prefill": True, "do_remote_decode": False}
            for o in outs]


def mismatches(decode: EngineProcess) -> float:
    return float(decode.call({"cmd": "connector_state"})["model_mismatch_declined"])


def test_prefill_marks_its_params(engines: dict[str, Any]) -> None:
    params = hand_out(engines["p"], [RandomPrompts(1)()])[0]
    assert params["kvbridge_identity"] == 1


def test_reads_from_another_model_are_declined(engines: dict[str, Any]) -> None:
    prompt = RandomPrompts(35)
    prompts = [prompt() for _ in range(3)]
    decode = engines["d-recompute"]
    own = [o["token_ids"] for o in decode.generate(prompts, MAX_TOKENS)]   # no transfer
    theirs = [o["token_ids"] for o in engines["p"].generate(prompts, MAX_TOKENS)]
    assert own != theirs, "precondition: the two engines serve different weights"
    received_ok(decode)
    outs = decode.generate(prompts, MAX_TOKENS, hand_out(engines["p"], prompts))
    assert [o["token_ids"] for o in outs] == own, "recomputed with the decode's weights"
    assert received_ok(decode) == [False] * 3, "every read declined"
    assert mismatches(decode) == 3
    # Both values are logged: the decode's own and the prefill's, as each engine states it.
    line = next(ln for ln in decode.log_tail(500_000).splitlines()
                if "remote engine mi-prefill serves another model" in ln)
    mine, theirs = re.findall(r"fingerprint '(sampled-v1:[0-9a-f]{64})'", line)
    assert (mine, theirs) == (engines["fingerprints"]["d"], engines["fingerprints"]["p"])

    fail = engines["d-fail"]
    received_ok(fail)
    outs = fail.generate(prompts, MAX_TOKENS, hand_out(engines["p"], prompts))
    for out in outs:
        assert out["finish_reason"] not in ("length", "stop") and \
            len(out["token_ids"]) < MAX_TOKENS, f"fail policy: an error, not tokens: {out}"
    assert received_ok(fail) == [False] * 3
    assert mismatches(fail) == 3
    print(f"declined: recompute {mismatches(decode):.0f}, fail {mismatches(fail):.0f}")
