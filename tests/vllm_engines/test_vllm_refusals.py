"""Settings KVBridgeConnector does not support fail the engine's start-up, with the setting
named in the error, never the first request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvbridge_testkit.vllm_harness import EngineError, EngineProcess

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CASES: dict[str, tuple[dict[str, Any], str]] = {
    "push-mode": ({"connector": "kvbridge-push"},
                  "KVBridgePushConnector: push mode (prefill WRITEs"),
    "backend": ({"connector": "kvbridge", "extra_config": {"backends": ["GDS"]}},
                "kv_connector_extra_config.backends=['GDS'] is not supported"),
    "bidirectional": ({"connector": "kvbridge",
                       "extra_config": {"bidirectional_kv_xfer": True}},
                      "kv_connector_extra_config.bidirectional_kv_xfer=True is not supported"),
    "static-peers": ({"connector": "kvbridge", "extra_config": {"kvbridge_peers": [{"host": 1}]}},
                     "kv_connector_extra_config.kvbridge_peers: expected objects with "
                     "engine_id, host, port"),
    "model-digest": ({"connector": "kvbridge",
                      "extra_config": {"kvbridge_model_digest": "sha1"}},
                     "kv_connector_extra_config.kvbridge_model_digest='sha1': expected one of "
                     "'sampled', 'full', 'off'"),
}


def test_unsupported_settings_fail_engine_start(llama_model: Path, engine_logs: Path) -> None:
    engines = {name: EngineProcess(llama_model, engine_logs, name=f"refuse-{name}", **kw)
               for name, (kw, _) in CASES.items()}
    for engine in engines.values():
        engine.start(wait=False)
    for name, engine in engines.items():
        with pytest.raises(EngineError) as err:
            engine.wait_ready()
        assert CASES[name][1] in str(err.value), f"{name}: {err.value}"
        assert engine.wait_exit(60) is not None, f"{name}: still running after refusing"
