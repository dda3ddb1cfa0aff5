"""NIXL settings for every process of a test engine, the TP workers vLLM spawns included.

``vllm_engine.py`` puts this directory on ``PYTHONPATH``, so Python imports this module at
start-up in the engine and in each worker process (they are spawned, and run none of the
engine's own start-up code). Two settings (docs/platform/vllm-on-cpu.md §2, §3):

- ``nixl`` resolves to ``nixl_cu12``: vLLM's connector imports ``nixl._api``, and the
  ``nixl`` meta package would pick ``nixl-cu13`` from the CUDA version torch's dependencies
  report and fail, so it is not installed;
- every NIXL agent's progress thread sleeps between polls: the wrapper hard-codes 0, which
  busy-spins a core per agent and starves the other engines' handshakes.

kvbridge needs neither (it imports whichever NIXL build is installed and sets the delay of
its own agents); vLLM's stock connector needs both.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

#: Progress-thread poll interval for every NIXL agent in this process (µs).
NIXL_PROGRESS_DELAY_US = 100
NIXL_ALIASES = ("", "._api", "._bindings", "._utils", ".logging")


def alias_nixl() -> None:
    """Make ``import nixl._api`` resolve to ``nixl_cu12``."""
    for suffix in NIXL_ALIASES:
        sys.modules.setdefault(f"nixl{suffix}", importlib.import_module(f"nixl_cu12{suffix}"))


def patch_nixl_progress_delay(delay_us: int) -> None:
    """Give every NIXL agent created in this process a sleeping progress thread.

    ``nixl_agent.__init__`` (nixl_cu12 1.5.1 ``_api.py``) builds a ``nixlAgentConfig`` with
    ``pthrDelay = 0`` and hands it to ``_bindings.nixlAgent``; it is the only caller of that
    constructor, so wrapping it reaches the stock connector's agent and any other one. A
    non-zero delay chosen by the caller (kvbridge's agents set their own) is kept.
    """
    bindings = importlib.import_module("nixl_cu12._bindings")
    original = bindings.nixlAgent
    if getattr(original, "_kvb_delay_patched", False):
        return

    def _agent(agent_name: str, agent_config: Any) -> Any:
        if agent_config.pthrDelay == 0:
            agent_config.pthrDelay = delay_us
        return original(agent_name, agent_config)

    _agent._kvb_delay_patched = True  # type: ignore[attr-defined]
    bindings.nixlAgent = _agent


try:
    alias_nixl()
    patch_nixl_progress_delay(NIXL_PROGRESS_DELAY_US)
except ImportError:   # a python without nixl_cu12 (write-model runs, for instance)
    pass
