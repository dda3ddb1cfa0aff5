"""The Dockerfile's promise to users: a plain `docker build .` gives the operator image."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def stage_names(text: str) -> list[str]:
    return re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE | re.IGNORECASE)


def test_a_plain_build_gives_the_operator_image() -> None:
    stages = stage_names(DOCKERFILE.read_text())
    assert stages[-1] == "operator", (
        f"the Dockerfile's last stage is {stages[-1]!r}: `docker build .` (the chart README's "
        "command) must give the operator image, so `operator` has to stay last"
    )


def test_every_documented_target_exists() -> None:
    stages = set(stage_names(DOCKERFILE.read_text()))
    assert {"operator", "agent", "vllm", "envoy"} <= stages
