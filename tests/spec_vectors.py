"""Locate the shared spec's acceptance vectors: ``$KVBRIDGE_SPEC_DIR`` or ``../shared/spec``
beside the repository (where CI and every checkout find it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def spec_dir() -> Path:
    override = os.environ.get("KVBRIDGE_SPEC_DIR")
    return Path(override) if override else REPO_ROOT.parent / "shared" / "spec"


def load_vectors(filename: str) -> Any:
    """Parse one vectors file; a missing file is an error, never a silent skip."""
    path = spec_dir() / "vectors" / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"spec vectors not found at {path}: the shared spec must sit next to the "
            "repository (../shared/spec/vectors) or KVBRIDGE_SPEC_DIR must point at it"
        )
    return json.loads(path.read_text())
