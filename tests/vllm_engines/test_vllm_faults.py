"""Faults around KVBridgeConnector in real vLLM engines: a prefill engine killed after it
handed out its blocks and before the decode's read completed, and a prefill restarted under
the same engine id and side-channel port (a new NIXL agent, a new epoch) while the decode
still has the old one loaded. The decode engine must not hang, must not produce tokens from
wrong KV, must follow its ``kv_load_failure_policy`` (``recompute``: the tokens equal one
engine's; ``fail``: the request ends in an error, not in tokens), and must serve the next
requests normally, through a fresh handshake with whatever engine serves there now."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge_testkit.vllm_harness import (
    EngineProcess,
    RandomPrompts,
    pd_generate,
    received_ok,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.nixl, pytest.mark.vllm]

MAX_TOKENS = 6
EXTRA = {"kvbridge_transfer_timeout_s": 10}   # a dead peer that never answers fails in 10 s


@pytest.fixture(scope="module")
def cluster_of_engines(vllm_py: str, engine_logs: Path, llama_model: Path
                       ) -> Iterator[dict[str, Any]]:  # fmt: skip
    made: dict[str, Any] = {
        "ref": EngineProcess(llama_model, engine_logs, name="f-ref"),
        "prefill": EngineProcess(llama_model, engine_logs, connector="kvbridge",
                                 kv_role="kv_producer", engine_id="f-prefill",
                                 name="f-prefill-1"),
        "recompute": EngineProcess(llama_model, engine_logs, connector="kvbridge",
                                   kv_role="kv_consumer", engine_id="f-d-recompute",
                                   load_failure_policy="recompute", extra_config=EXTRA),
        "fail": EngineProcess(llama_model, engine_logs, connector="kvbridge",
                              kv_role="kv_consumer", engine_id="f-d-fail",
                              load_failure_policy="fail", extra_config=EXTRA),
    }
    with running(made):
        yield made


def restart_prefill(engines: dict[str, Any], engine_logs: Path, llama_model: Path,
                    n: int) -> EngineProcess:
    """SIGKILL the prefill (if alive) and start a new process as the same engine id on the
    same side-channel port."""
    old: EngineProcess = engines["prefill"]
    old.kill()
    new = EngineProcess(llama_model, engine_logs, connector="kvbridge", kv_role="kv_producer",
                        engine_id=old.engine_id, name=f"f-prefill-{n}", port=old.port)
    engines["prefill"] = new.start()
    return new


def reference(engines: dict[str, Any], prompt: list[int]) -> list[int]:
    return engines["ref"].generate([prompt], MAX_TOKENS)[0]["token_ids"]


def test_prefill_killed_then_restarted(cluster_of_engines: dict[str, Any], engine_logs: Path,
                                       llama_model: Path) -> None:
    engines, prompt = cluster_of_engines, RandomPrompts(5)
    rec, fail = engines["recompute"], engines["fail"]

    # Healthy: both decoders pull from the prefill (and so hold its NIXL agent loaded).
    for decode in (rec, fail):
        p = prompt()
        assert pd_generate(engines["prefill"], decode, [p], MAX_TOKENS)[0].token_ids == \
            reference(engines, p)
        assert received_ok(decode) == [True]

    # The prefill hands out its blocks, then dies before the decoders read them.
    p_rec, p_fail = prompt(), prompt()
    handed = engines["prefill"].generate([p_rec, p_fail], 1, [{"do_remote_decode": True}] * 2)
    params = [{**h["kv_transfer_params"], "do_remote_prefill": True, "do_remote_decode": False}
              for h in handed]
    engines["prefill"].kill()

    out = rec.generate([p_rec], MAX_TOKENS, [params[0]])[0]
    assert out["token_ids"] == reference(engines, p_rec), "recompute policy: one engine's tokens"
    assert received_ok(rec) == [False]
    out = fail.generate([p_fail], MAX_TOKENS, [params[1]])[0]
    assert out["finish_reason"] not in ("length", "stop") and \
        len(out["token_ids"]) < MAX_TOKENS, f"fail policy: an error, not tokens: {out}"
    assert received_ok(fail) == [False]

    # A new prefill process under the same engine id and port: the failed read dropped the
    # dead peer, so the next request handshakes with the new agent and pulls.
    restart_prefill(engines, engine_logs, llama_model, 2)
    for decode in (rec, fail):
        p = prompt()
        assert pd_generate(engines["prefill"], decode, [p], MAX_TOKENS)[0].token_ids == \
            reference(engines, p)
        assert received_ok(decode) == [True]

    # Restarted again while both decoders still hold the previous agent (nothing failed in
    # between): the first read meets the stale agent and fails typed, never with wrong KV;
    # recompute gives the right tokens; then the decoders pull from the new agent.
    restart_prefill(engines, engine_logs, llama_model, 3)
    p = prompt()
    assert pd_generate(engines["prefill"], rec, [p], MAX_TOKENS)[0].token_ids == \
        reference(engines, p)
    received_ok(rec)
    for decode in (rec, fail):
        for _ in range(2):   # fail: the first may end in an error (its stale read)
            p = prompt()
            out = pd_generate(engines["prefill"], decode, [p], MAX_TOKENS)[0]
            ok = received_ok(decode)
            if ok == [True]:
                break
        assert ok == [True], f"{decode.name} does not pull again after the restart"
        assert out.token_ids == reference(engines, p)
    assert rec.alive and fail.alive
