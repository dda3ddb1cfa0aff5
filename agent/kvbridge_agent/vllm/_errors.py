"""The error the connector refuses a setting with, in a module that imports no vLLM, so that
the settings readers that need none (:mod:`._model`) can be tested without it."""

from __future__ import annotations

from ..errors import KVBridgeError

__all__ = ["UnsupportedVllmSettingError"]


class UnsupportedVllmSettingError(KVBridgeError, ValueError):
    """A vLLM setting the kvbridge connector does not support; the message names it."""
