"""The root of every error the agent raises, as httpx has ``HTTPError``.

Each package's base error (``ProtocolError``, ``GeometryError``, ``SideChannelError``,
``DataPlaneError``, ``AgentError``, ...) derives from :class:`KVBridgeError` *and* keeps the
built-in base callers caught before it existed (``ValueError``, ``RuntimeError``, ...), so
``except KVBridgeError`` catches any of them and no existing ``except`` changes meaning.
Pure: importing it loads nothing else.
"""

from __future__ import annotations

__all__ = ["KVBridgeError"]


class KVBridgeError(Exception):
    """Base of every error the kvbridge agent raises on purpose."""
