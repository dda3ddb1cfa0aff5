"""Which files of a model directory make up the model, in a canonical order. Pure.

The compatibility hash a prefill and a decode compare covers the model's name and shapes, not
the numbers it computes with. Those come from the weights, the tokenizer (the prompt's token
ids are the KV cache's input), the chat template, the configs (``config.json``,
``generation_config.json``, a quantization config) and, for ``trust_remote_code`` models,
their Python modelling code. Everything else a model directory tends to hold (README,
LICENSE, images, ``.gitattributes``, a ``.cache`` of partial downloads) cannot change an
answer, and only costs time and churns the fingerprint when it changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WEIGHT_SUFFIXES", "ModelFile", "is_model_file", "model_files"]

#: Weight formats vLLM loads.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

#: Tokenizer, config, template and modelling-code files (by suffix).
_OTHER_SUFFIXES = (".json", ".model", ".tiktoken", ".jinja", ".py")

#: Tokenizer files whose suffix says nothing (``merges.txt``, ``vocab.txt``, ``vocab.bpe``).
_NAMES = ("merges.txt",)
_PREFIXES = ("vocab.",)


@dataclass(frozen=True)
class ModelFile:
    """One file of the model: ``rel`` is its path under the model directory with ``/``
    separators (what the fingerprint names it by), ``path`` where it is read from."""

    rel: str
    path: str
    size: int


def is_model_file(name: str) -> bool:
    """Whether a file called ``name`` belongs to the model (module docstring)."""
    lower = name.lower()
    if lower.startswith("."):
        return False
    return (lower.endswith(WEIGHT_SUFFIXES + _OTHER_SUFFIXES) or lower in _NAMES
            or lower.startswith(_PREFIXES))


def model_files(directory: str | os.PathLike[str]) -> list[ModelFile]:
    """The model's files under ``directory``, recursively, sorted by relative path.

    Hidden directories (``.cache``, ``.git``, ``.huggingface``) are skipped. Symbolic links are
    followed (a Hugging Face snapshot is a directory of links into ``blobs/``), each real
    directory once, so a link cycle ends. The sizes are those of the link targets.
    """
    root = Path(directory)
    if not root.is_dir():
        raise NotADirectoryError(f"not a model directory: {str(root)!r}")
    out: list[ModelFile] = []
    seen: set[str] = set()
    for here, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_dir = Path(here).relative_to(root).as_posix()
        for name in names:
            if not is_model_file(name):
                continue
            path = os.path.join(here, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:   # a dangling link: nothing to read
                continue
            if not os.path.isfile(path):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            out.append(ModelFile(rel, path, int(st.st_size)))
    out.sort(key=lambda f: f.rel.encode("utf-8"))
    return out
