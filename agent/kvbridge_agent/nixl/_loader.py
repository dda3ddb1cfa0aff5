"""Import whichever NIXL build is installed, exactly once per process.

NIXL ships as ``nixl`` (meta package, imports torch to pick a CUDA build), ``nixl_cu12`` and
``nixl_cu13``. Two builds must never be imported into one process (pybind11 refuses to
register ``nixl_thread_sync_t`` twice), so the first one found wins and is cached.
"""

from __future__ import annotations

import importlib
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

from ..errors import KVBridgeError

__all__ = ["CANDIDATES", "NixlModule", "NixlUnavailableError", "load_nixl"]

#: Import order: the meta package first (it knows the CUDA major), then the explicit builds.
CANDIDATES: tuple[str, ...] = ("nixl", "nixl_cu12", "nixl_cu13")

_lock = threading.Lock()
_loaded: NixlModule | None = None


class NixlUnavailableError(KVBridgeError, ImportError):
    """No NIXL Python package could be imported."""


@dataclass(frozen=True)
class NixlModule:
    """The pieces of one NIXL build the wrapper uses."""

    package: str            # "nixl", "nixl_cu12" or "nixl_cu13"
    api: ModuleType         # <package>._api (nixl_agent, nixl_agent_config)
    bindings: ModuleType    # <package>._bindings (nixlAgent, exception classes, NIXL_INIT_AGENT)


def load_nixl() -> NixlModule:
    """Return the installed NIXL build, importing it on first use.

    Raises:
        NixlUnavailableError: none of ``nixl._api``, ``nixl_cu12._api``, ``nixl_cu13._api``
            imports; the message lists each attempt and how to install one.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        failures: list[str] = []
        for package in CANDIDATES:
            # A failed `import nixl` may already have loaded one build's bindings; a second
            # build in the same process would fail to import, so only that one is tried.
            loaded = [c for c in CANDIDATES[1:] if f"{c}._bindings" in sys.modules]
            if loaded and package != "nixl" and package not in loaded:
                failures.append(f"{package}._api: skipped, {loaded[0]} is already loaded")
                continue
            try:
                api = importlib.import_module(f"{package}._api")
            except ImportError as exc:
                failures.append(f"{package}._api: {exc}")
                continue
            _loaded = NixlModule(package=package, api=api, bindings=api.nixlBind)
            return _loaded
        raise NixlUnavailableError(
            "no NIXL Python package is importable (tried "
            + "; ".join(failures)
            + "). Install one, e.g. `pip install --no-deps nixl-cu12==1.5.1` "
            "(CPU or CUDA 12) or `pip install nixl==1.5.1` (picks the build for your torch)."
        )
