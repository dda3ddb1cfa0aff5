"""Load the protocol's acceptance vectors (wire bytes, compatibility hashes, descriptor ids),
kept in the repository at ``tests/data/protocol-vectors/`` and described in
docs/protocol.md (§1.3, §1.5, §3.9)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
VECTORS_DIR = REPO_ROOT / "tests" / "data" / "protocol-vectors"


def load_vectors(filename: str) -> Any:
    """Parse one vectors file; a missing file is an error, never a silent skip."""
    path = VECTORS_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"protocol vectors not found at {path}: they are part of the repository "
            "(tests/data/protocol-vectors/); restore the file from git"
        )
    return json.loads(path.read_text())
