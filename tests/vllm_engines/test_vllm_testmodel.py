"""The test model ``kvbridge write-test-model`` writes, read by the libraries vLLM reads it
with (in the vLLM venv): safetensors gives back the seeded weights, transformers loads the
tokenizer, which round-trips text and decodes every id the model can emit, and the chat
template renders. The serving pods (tests/node/test_serving_vllm.py) run vLLM on it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvbridge_agent import _testmodel as tm
from kvbridge_testkit.vllm_harness import vllm_python

pytestmark = [pytest.mark.vllm]

CHECK = r"""
import json, sys
from safetensors.numpy import load_file
from transformers import AutoTokenizer
d = sys.argv[1]
weights = load_file(d + "/model.safetensors")
tok = AutoTokenizer.from_pretrained(d)
text = "alpha bravo, charlie! 42 \u00e9t\u00e9"
ids = tok.encode(text, add_special_tokens=False)
print(json.dumps({
    "sums": {k: float(v.astype("float64").sum()) for k, v in weights.items()},
    "dtypes": sorted({str(v.dtype) for v in weights.values()}),
    "len": len(tok), "roundtrip": tok.decode(ids) == text, "merged": len(ids) < len(text.encode()),
    "all_ids_decode": all(isinstance(tok.decode([i]), str) for i in range(len(tok))),
    "chat": tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True),
}))
"""


def test_real_libraries_load_the_test_model(tmp_path: Path) -> None:
    try:
        python = vllm_python()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    tm.write_test_model(tmp_path, seed=9)
    out = subprocess.run([python, "-c", CHECK, str(tmp_path)], capture_output=True, text=True,
                         timeout=180, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {k: float(v.astype(np.float64).sum()) for k, v in tm.weights(9).items()}
    assert got["sums"] == expected and got["dtypes"] == ["float32"]
    assert got["len"] == tm.CONFIG["vocab_size"]
    assert got["roundtrip"] and got["merged"] and got["all_ids_decode"]
    assert got["chat"] == "<|user|>hi\n<|assistant|>"
