"""Where a served model's files are, and which revision of it they are.

vLLM takes a model as a local path or as a Hugging Face repository id it downloads into the
cache (``<cache>/models--org--name/snapshots/<commit>/``). The fingerprint needs the local
directory either way; the revision is the commit where one is known, so that an operator
reading the KVEndpoints sees which revision each engine serves. Neither may fail an
engine's start: what cannot be found is published empty, with one warning.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

__all__ = ["local_model_dir", "model_revision", "snapshot_commit"]

log = logging.getLogger("kvbridge.identity")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_warned: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> None:
    """Log ``message`` at WARNING the first time ``key`` is seen in this process (a worker
    process per TP rank: one line per rank, not one per retry)."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def snapshot_commit(path: str | os.PathLike[str]) -> str:
    """The commit of a Hugging Face snapshot ``path`` lies in (``…/snapshots/<40 hex>/…``),
    as given or with its links resolved; "" for any other path."""
    for candidate in (Path(path), Path(path).resolve()):
        parts = candidate.parts
        for i in range(len(parts) - 1, 0, -1):
            if parts[i - 1] == "snapshots" and _COMMIT.match(parts[i]):
                return parts[i]
    return ""


def model_revision(model: str, revision: str | None = None,
                   local_dir: str | os.PathLike[str] | None = None) -> str:
    """vLLM's ``--revision`` when set, else the snapshot commit of ``local_dir`` (or of
    ``model``, when it is a path), else ""."""
    if revision:
        return str(revision)
    for path in (local_dir, model):
        if path:
            commit = snapshot_commit(path)
            if commit:
                return commit
    return ""


def local_model_dir(model: str, revision: str | None = None) -> Path | None:
    """The local directory of ``model``: itself when it is a directory, else its snapshot in
    the Hugging Face cache when ``huggingface_hub`` is installed and has one (never a
    download); None otherwise, with a warning (once)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        warn_once(f"hub:{model}", "kvbridge: model %r is not a local directory and "
                  "huggingface_hub is not installed: publishing no model fingerprint", model)
        return None
    try:
        found = snapshot_download(model, revision=revision or None, local_files_only=True)
    except Exception as exc:   # not cached, an offline hub, a malformed id: not fatal
        warn_once(f"hub:{model}", "kvbridge: no local snapshot of model %r (%s): publishing "
                  "no model fingerprint", model, exc)
        return None
    return Path(found)
