"""Each package has one error tree: every exception class it defines descends from its base
(the agent's ``KVBridgeError``, the operator's ``OperatorError``, the router's
``RouterError``, both of those under ``KVBridgeError``), and its errors module's docstring
draws every one of them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

from kvbridge_agent.errors import KVBridgeError
from kvbridge_operator.errors import OperatorError
from kvbridge_router.errors import RouterError

#: Modules that need an engine this environment may lack (vLLM): left out when absent.
OPTIONAL = {"vllm"}

TREES = {
    "kvbridge_agent": KVBridgeError,
    "kvbridge_operator": OperatorError,
    "kvbridge_router": RouterError,
}


def _modules(package: str) -> list[ModuleType]:
    root = importlib.import_module(package)
    out = [root]
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        try:
            out.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in OPTIONAL:
                raise
    return out


def _exceptions(package: str) -> set[type[BaseException]]:
    found = set()
    for module in _modules(package):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.split(".")[0] == package:
                found.add(cls)
    return found


@pytest.mark.parametrize("package", sorted(TREES))
def test_every_exception_descends_from_the_package_base(package: str) -> None:
    base = TREES[package]
    classes = _exceptions(package)
    assert base in classes
    assert sorted(c.__qualname__ for c in classes if not issubclass(c, base)) == []


@pytest.mark.parametrize("package", sorted(TREES))
def test_the_errors_module_draws_every_exception(package: str) -> None:
    drawing = importlib.import_module(f"{package}.errors").__doc__ or ""
    missing = sorted(c.__name__ for c in _exceptions(package) if c.__name__ not in drawing)
    assert missing == []


def test_the_operator_and_router_bases_are_kvbridge_errors() -> None:
    assert issubclass(OperatorError, KVBridgeError)
    assert issubclass(RouterError, KVBridgeError)


def test_existing_excepts_still_catch() -> None:
    """The built-in bases callers caught before stay (the trees only widen)."""
    from kvbridge_operator.errors import SpecError
    from kvbridge_operator.kube import KubeError, KubeUnavailable
    from kvbridge_operator.limits import UnboundedError
    from kvbridge_router.flow import RequestError
    from kvbridge_router.kv_events import EventError

    assert issubclass(SpecError, ValueError) and issubclass(UnboundedError, ValueError)
    assert issubclass(KubeError, RuntimeError) and issubclass(KubeUnavailable, KubeError)
    assert issubclass(RequestError, ValueError) and issubclass(EventError, ValueError)
