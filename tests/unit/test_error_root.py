"""Every package's base error derives from the one root, and keeps its built-in base."""

from __future__ import annotations

import pytest

from kvbridge_agent.errors import KVBridgeError
from kvbridge_agent.geometry import GeometryError
from kvbridge_agent.kube import PublishError
from kvbridge_agent.kube._identity import PodLabelsError
from kvbridge_agent.nixl import DataPlaneError, NixlUnavailableError, NotificationError
from kvbridge_agent.protocol import ProtocolError
from kvbridge_agent.service import AgentError, UnknownRequestError
from kvbridge_agent.sidechannel import SideChannelError


@pytest.mark.parametrize(("error", "builtin"), [
    (ProtocolError, ValueError),
    (GeometryError, ValueError),
    (SideChannelError, RuntimeError),
    (DataPlaneError, RuntimeError),
    (NixlUnavailableError, ImportError),
    (NotificationError, ValueError),
    (AgentError, Exception),
    (UnknownRequestError, KeyError),
    (PublishError, RuntimeError),
    (PodLabelsError, ValueError),
])
def test_package_errors_share_the_root_and_keep_their_builtin(error, builtin) -> None:
    assert issubclass(error, KVBridgeError)
    assert issubclass(error, builtin)
    with pytest.raises(KVBridgeError):
        raise error("x")
