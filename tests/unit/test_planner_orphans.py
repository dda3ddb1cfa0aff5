"""KVEndpoints whose KVTransfer does not exist: the Orphaned status, written once. No cluster."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from kvbridge_operator import reconciler
from kvbridge_operator import status as st
from kvbridge_operator import testing as T
from kvbridge_operator.kube import Kube, KubeError, KubeUnavailable
from kvbridge_operator.spec import Endpoint, parse_endpoint


class FakeKube:
    """Records status patches; ``conflict`` answers as a 409 on a stale resourceVersion."""

    def __init__(self, conflict: bool = False) -> None:
        self.patches: list[tuple[str, str, dict[str, Any], str | None]] = []
        self.conflict = conflict

    async def patch_endpoint_status(self, namespace: str, name: str, status: dict,
                                    resource_version: str | None = None) -> bool:  # fmt: skip
        self.patches.append((namespace, name, status, resource_version))
        return not self.conflict


def orphan_ep(**kw: Any) -> Endpoint:
    body = T.endpoint_manifest("d0-0", role="decode", engine_id="d0", transfer="gone",
                               namespace="serving", **kw)  # fmt: skip
    body["metadata"].update(resourceVersion="42", generation=3)
    return parse_endpoint(body)


def orphan(e: Endpoint, kube: FakeKube, **kw: Any) -> bool:
    return asyncio.run(reconciler.orphan(e, kube, **kw))  # type: ignore[arg-type]


def test_orphan_status_names_the_transfer_and_namespace() -> None:
    e = orphan_ep()
    s = st.orphaned_endpoint_status(e)
    assert (s["state"], s["reason"], s["peers"]) == ("Orphaned", "TransferNotFound", [])
    assert "KVTransfer named gone (spec.transferName)" in s["message"]
    assert "namespace serving" in s["message"]
    assert (s["observedGeneration"], s["observedEpoch"]) == (3, 1)
    d = st.orphaned_endpoint_status(e, deleted=True)
    assert d["reason"] == "TransferDeleted" and "gone" in d["message"] and "deleted" in d["message"]
    assert set(s) == set(d) == set(st.ENDPOINT_KEYS)  # replaces every operator-owned key


def test_orphan_is_written_once_with_a_resource_version_precondition() -> None:
    e, kube = orphan_ep(), FakeKube()
    assert orphan(e, kube)
    assert kube.patches == [("serving", "d0-0", st.orphaned_endpoint_status(e), "42")]
    echoed = dataclasses.replace(e, status=kube.patches[0][2], resource_version="43")
    assert not orphan(echoed, kube)  # the watch echo: nothing to write
    assert len(kube.patches) == 1


def test_transfer_deleted_is_kept_until_the_spec_changes() -> None:
    e, kube = orphan_ep(), FakeKube()
    assert orphan(e, kube, deleted=True)
    deleted = dataclasses.replace(e, status=kube.patches[0][2])
    assert not orphan(deleted, kube)  # a later event does not downgrade to TransferNotFound
    assert len(kube.patches) == 1
    restarted = dataclasses.replace(deleted, generation=4, epoch=2)
    assert orphan(restarted, kube)
    assert kube.patches[-1][2]["reason"] == "TransferNotFound"
    assert kube.patches[-1][2]["observedEpoch"] == 2


def test_orphan_overwrites_a_stale_plan_but_not_a_terminating_endpoint() -> None:
    planned = {"state": "Paired", "reason": "Paired", "message": "", "peers": [{"name": "p"}]}
    e, kube = dataclasses.replace(orphan_ep(), status=planned), FakeKube()
    assert orphan(e, kube)
    assert kube.patches[0][2]["peers"] == []
    assert not orphan(dataclasses.replace(e, deleting=True), kube)
    assert not orphan(e, FakeKube(conflict=True))  # lost against a newer write: not counted
    assert len(kube.patches) == 1


class FailingKube(FakeKube):
    """Fails the status patches of the endpoints in ``failures``, that many times each
    (``None``: always), as RBAC or an API server outage would."""

    def __init__(self, failures: dict[str, int | None], error: type[KubeError] = KubeError
                 ) -> None:  # fmt: skip
        super().__init__()
        self.failures = failures
        self.error = error

    async def patch_endpoint_status(self, namespace: str, name: str, status: dict,
                                    resource_version: str | None = None) -> bool:  # fmt: skip
        self.patches.append((namespace, name, status, resource_version))
        left = self.failures.get(name, 0)
        if left is None or left > 0:
            if left is not None:
                self.failures[name] = left - 1
            raise self.error(f"patching kvendpoints/{name} status: 403 Forbidden"
                             if self.error is KubeError else "API server unreachable")
        return True


def release_eps() -> list[Endpoint]:
    return [parse_endpoint(T.endpoint_manifest(n, role="decode", engine_id=n[:2],
                                               transfer="kvt", namespace="serving"))
            for n in ("d0-0", "d1-0")]  # fmt: skip


def release(kube: FailingKube, delays: tuple[float, ...]) -> int:
    return asyncio.run(reconciler.release("serving", "kvt", release_eps(), kube,  # type: ignore[arg-type]
                                          retry_delays=delays))  # fmt: skip


def test_release_lets_the_finalizer_go_after_a_refusal(caplog) -> None:
    """A write the API server keeps refusing is retried, then logged: the delete handler
    returns, so kopf removes the finalizer; the endpoints that could be told are told."""
    kube = FailingKube({"d1-0": None})
    assert release(kube, (0.0, 0.0)) == 1
    assert [p[1] for p in kube.patches] == ["d0-0", "d1-0", "d1-0", "d1-0"]  # 1 + 2 retries
    assert all(p[2]["reason"] == "TransferDeleted" for p in kube.patches)
    assert "d1-0 could not be told" in caplog.text and "403 Forbidden" in caplog.text


def test_release_retries_a_transient_failure_until_written() -> None:
    kube = FailingKube({"d1-0": 1})
    assert release(kube, (0.0, 0.0)) == 2
    assert [p[1] for p in kube.patches] == ["d0-0", "d1-0", "d1-0"]


def test_release_is_deferred_while_the_api_server_does_not_answer(caplog) -> None:
    """Unanswered writes (an API server restarting) do not let the finalizer go: the
    KVTransfer could vanish before any event told its endpoints (a resumed watch does not
    replay the deletion), so the handler asks kopf to run it again."""
    kube = FailingKube({"d1-0": None}, error=KubeUnavailable)
    try:
        release(kube, (0.0, 0.0))
    except reconciler.ReleaseDeferred as exc:
        assert "d1-0" in str(exc) and "d0-0" not in str(exc)
    else:
        raise AssertionError("release returned while an endpoint was not told")
    assert [p[1] for p in kube.patches] == ["d0-0", "d1-0", "d1-0", "d1-0"]
    assert "releasing the finalizer anyway" not in caplog.text
    # the API server answers again: the next run tells both (its index still holds the old
    # statuses) and returns, so kopf lets the finalizer go
    kube.failures["d1-0"] = 0
    assert release(kube, (0.0, 0.0)) == 2
    assert [p[1] for p in kube.patches[-2:]] == ["d0-0", "d1-0"]


class _Api:
    """The one CustomObjectsApi call Kube's patches make, failing as told."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def patch_namespaced_custom_object_status(self, *args: Any) -> None:
        raise self.error


def _patch(error: BaseException) -> bool:
    kube = Kube.__new__(Kube)           # no kubeconfig: only the error handling is exercised
    kube._api = _Api(error)             # type: ignore[assignment]
    kube._pool = __import__("concurrent.futures").futures.ThreadPoolExecutor(1)
    try:
        return asyncio.run(kube.patch_endpoint_status("serving", "d0-0", {}))
    finally:
        kube.close()


def test_kube_tells_an_unanswered_call_from_a_refusal() -> None:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import MaxRetryError

    def api_error(status: int, body: str) -> ApiException:
        exc = ApiException(status=status, reason="x")
        exc.body = body
        return exc

    status_404 = '{"kind": "Status", "reason": "NotFound", "code": 404}'
    assert _patch(api_error(404, status_404)) is False              # the object is gone
    for unanswered in (api_error(404, "404 page not found"), api_error(503, ""),
                       api_error(429, ""), MaxRetryError(None, "/", "refused")):
        try:
            _patch(unanswered)
        except KubeUnavailable:
            pass
        else:
            raise AssertionError(f"{unanswered!r} not reported as unanswered")
    for refused in (api_error(403, '{"kind": "Status"}'), api_error(422, '{"kind": "Status"}')):
        try:
            _patch(refused)
        except KubeUnavailable:
            raise AssertionError(f"{refused!r} reported as unanswered") from None
        except KubeError:
            pass
