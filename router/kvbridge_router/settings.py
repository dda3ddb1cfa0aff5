"""The router's settings (``__main__`` fills them from its flags; the sidecar and the
endpoint picker share them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .affinity import TrackingSettings
from .balance import ChooserSettings

__all__ = ["RouterSettings"]


@dataclass(frozen=True)
class RouterSettings:
    engine_port: int = 8000
    #: the prefills' kv_lease_duration (vLLM's default) and the part of it kept in reserve
    lease_s: float = 30.0
    lease_margin_s: float = 5.0
    prefill_timeout_s: float = 300.0
    #: connecting to a decode and receiving its response headers
    decode_connect_timeout_s: float = 30.0
    #: the largest request body; a larger declared Content-Length is refused at once (413)
    max_body_bytes: int = 64 * 2**20
    #: reading a request's whole body, once its headers arrived (408 past it)
    body_timeout_s: float = 30.0
    #: a connection's time to deliver a complete request line and headers, from its opening
    #: or from the end of its previous answer. This is aiohttp's keep-alive timer (its
    #: RequestHandler closes a connection still waiting for a request when it fires, and
    #: arms it at the connection's start), so an idle keep-alive connection closes as late;
    #: vLLM's own server closes idle connections after 5 s.
    header_timeout_s: float = 15.0
    #: P/D requests one request may fan out into (batched prompts × n, batching.py)
    max_fanout: int = 256
    #: which pair: the policy and its weights (balance.py)
    chooser: ChooserSettings = field(default_factory=ChooserSettings)
    #: how the cache-aware policy learns what engines hold and how busy they are (affinity.py)
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
