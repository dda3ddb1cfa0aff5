"""The root of every error the agent raises, as httpx has ``HTTPError``.

Each package's base error (``ProtocolError``, ``GeometryError``, ``SideChannelError``,
``DataPlaneError``, ``AgentError``, ...) derives from :class:`KVBridgeError` *and* keeps the
built-in base callers caught before it existed (``ValueError``, ``RuntimeError``, ...), so
``except KVBridgeError`` catches any of them and no existing ``except`` changes meaning.
Pure: importing it loads nothing else. The tree (built-in second bases in parentheses; the
operator's ``OperatorError`` and the router's ``RouterError`` hang here too)::

    KVBridgeError
    ├── ProtocolError (ValueError)                      protocol
    │   ├── RequestDecodeError
    │   ├── PayloadDecodeError
    │   ├── MetadataDecodeError
    │   ├── TimestampDecodeError
    │   ├── HashMismatchError
    │   ├── ConnectorVersionError
    │   ├── EngineIdMismatchError
    │   └── IncompatibleGeometryError
    ├── GeometryError (ValueError)                      geometry
    │   ├── CacheViewError
    │   ├── RegionAliasError
    │   ├── MemoryTypeConflictError
    │   ├── GroupLayoutError
    │   ├── BlockIdRangeError
    │   ├── PrefixAlignmentError
    │   ├── TPMappingError
    │   └── UnsupportedGeometryError (NotImplementedError)
    ├── SideChannelError (RuntimeError)                 sidechannel
    │   ├── HandshakeTimeoutError (TimeoutError)
    │   ├── RemoteRejectedError
    │   └── ReplyFormatError
    ├── DataPlaneError (RuntimeError)                   nixl
    │   ├── NixlCallError
    │   ├── RemoteNotFoundError (KeyError)
    │   └── UnsupportedTransferError (NotImplementedError)
    ├── NixlUnavailableError (ImportError)              nixl
    ├── NotificationError (ValueError)                  nixl
    ├── AgentError                                      service
    │   ├── WrongSideError (RuntimeError)
    │   ├── AgentClosedError (RuntimeError)
    │   ├── UnknownRequestError (KeyError)
    │   └── StalePeerError (RuntimeError)
    ├── PublishError (RuntimeError)                     kube
    ├── PodLabelsError (ValueError)                     kube
    ├── UnsupportedLayoutError (ValueError)             vllm
    ├── UnsupportedVllmSettingError (ValueError)        vllm
    ├── UntestedVllmError (RuntimeError)                vllm
    └── CliFailure                                      cli (a command's exit code and reason)
"""

from __future__ import annotations

__all__ = ["KVBridgeError"]


class KVBridgeError(Exception):
    """Base of every error the kvbridge agent raises on purpose."""
