"""The only Kubernetes API caller besides kopf itself: status merge patches.

Uses the official client in a small thread pool (it is synchronous). 404 on a patch is
tolerated (the object went away; its deletion triggers a new plan anyway), and so is 409 on a
patch with a ``resourceVersion`` precondition (the object changed since it was read; its
watch event brings the new state); other API errors become :class:`KubeError` naming the
object, or :class:`KubeUnavailable` when the API server could not answer at all (not
reachable, 5xx, 429, or the plain "404 page not found" of one still starting, which is no
statement about the object).

With leader election every status write first asks ``may_write`` (the Lease holder's
:meth:`~.leader.LeaderElector.leading`), so a replica that does not hold the Lease, or whose
term has lapsed, sends nothing: :class:`NotLeading`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from .config import ENDPOINTS, GROUP, TRANSFERS, VERSION
from .errors import OperatorError


class KubeError(OperatorError, RuntimeError):
    """A Kubernetes API call failed (other than 404)."""


class KubeUnavailable(KubeError):
    """The API server did not answer the call (unreachable, overloaded, starting): unlike a
    refusal, trying again later can succeed."""


class NotLeading(OperatorError):
    """This replica does not hold the operator's Lease (or no longer): it writes nothing."""


def _no_answer(exc: ApiException) -> bool:
    """Whether ``exc`` says nothing about the object: a server error, throttling, or a 404
    whose body is not a Kubernetes ``Status`` (a starting API server's "page not found")."""
    if exc.status is None or exc.status >= 500 or exc.status == 429:
        return True
    if exc.status != 404:
        return False
    try:
        return json.loads(exc.body or "").get("kind") != "Status"
    except (ValueError, AttributeError):
        return True


def load_api_client() -> client.ApiClient:
    """In-cluster credentials when available, else KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    #: Asked before every status write (None: always write); see the module docstring.
    _may_write: Callable[[], bool] | None = None

    def __init__(self, api_client: client.ApiClient | None = None, concurrency: int = 8, *,
                 may_write: Callable[[], bool] | None = None) -> None:  # fmt: skip
        self._api = client.CustomObjectsApi(api_client or load_api_client())
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kvb-kube")
        self._may_write = may_write

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _patch_status(
        self,
        plural: str,
        namespace: str,
        name: str,
        status: dict,
        resource_version: str | None = None,
    ) -> bool:
        if self._may_write is not None and not self._may_write():
            raise NotLeading(f"not the operator's Lease holder: {plural}/{name} status in "
                             f"{namespace} left unwritten")  # fmt: skip
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            await self._call(
                self._api.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                namespace,
                plural,
                name,
                body,
            )
        except ApiException as exc:
            what = f"patching {plural}/{name} status in {namespace}: {exc.status} {exc.reason}"
            if _no_answer(exc):
                raise KubeUnavailable(what) from exc
            if exc.status == 404 or (exc.status == 409 and resource_version):
                return False
            raise KubeError(what) from exc
        except HTTPError as exc:        # connection refused, reset, timed out
            raise KubeUnavailable(
                f"patching {plural}/{name} status in {namespace}: API server unreachable "
                f"({type(exc).__name__})") from exc
        return True

    async def patch_transfer_status(self, namespace: str, name: str, status: dict) -> bool:
        """Merge-patch a KVTransfer's status; False when the object is gone."""
        return await self._patch_status(TRANSFERS, namespace, name, status)

    async def patch_endpoint_status(
        self, namespace: str, name: str, status: dict, resource_version: str | None = None
    ) -> bool:
        """Merge-patch operator-owned KVEndpoint status keys; False when the object is gone,
        or, with ``resource_version``, when it changed since that version."""
        return await self._patch_status(ENDPOINTS, namespace, name, status, resource_version)

    async def endpoint_uids(self, namespace: str) -> set[str]:
        """UIDs of the KVEndpoints stored in ``namespace`` now (one LIST)."""
        listed = await self._call(
            self._api.list_namespaced_custom_object, GROUP, VERSION, namespace, ENDPOINTS
        )
        return {item["metadata"]["uid"] for item in listed.get("items") or ()}

    async def endpoint_uid(self, namespace: str, name: str) -> str | None:
        """UID of the KVEndpoint stored as ``namespace/name`` now; None when there is none."""
        try:
            obj = await self._call(
                self._api.get_namespaced_custom_object, GROUP, VERSION, namespace, ENDPOINTS, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise KubeError(
                f"reading {ENDPOINTS}/{name} in {namespace}: {exc.status} {exc.reason}"
            ) from exc
        return str(obj["metadata"]["uid"])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
