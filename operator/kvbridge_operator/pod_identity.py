"""Admission rule: a KVEndpoint may only be written by the pod that owns it. Pure.

A serving pod authenticates with a ServiceAccount token bound to the Pod (projected token,
or ``kubectl create token SA --bound-object-kind Pod --bound-object-name POD``); the apiserver
then puts the pod's name in ``request.userInfo.extra["authentication.kubernetes.io/pod-name"]``
(and its uid in ``.../pod-uid``). The KVEndpoint's owner Pod (its ``ownerReferences`` entry
of kind Pod, else ``spec.podName``) must be that pod, so one pod cannot publish or overwrite
another pod's geometry or side-channel address.

Exempt (clear rule): users in the group ``system:masters`` (cluster admins), the operator's
own ServiceAccount(s) given in ``exempt_users`` (e.g.
``system:serviceaccount:kvbridge-system:kvbridge-operator``), and the garbage collector /
controllers (usernames ``system:kube-controller-manager`` or
``system:serviceaccount:kube-system:*``), which remove finalizers and ownerReferences.
Any other requester without a pod-bound token is rejected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvbridge_agent.resources import ENDPOINT_FIELDS, SPEC

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
ADMIN_GROUPS = frozenset({"system:masters"})
CONTROLLER_USERS = frozenset({"system:kube-controller-manager"})
CONTROLLER_SA_PREFIX = "system:serviceaccount:kube-system:"


def _extra(userinfo: Mapping[str, Any], key: str) -> str | None:
    values = (userinfo.get("extra") or {}).get(key)
    if isinstance(values, str):
        return values
    if isinstance(values, Sequence) and len(values) == 1 and isinstance(values[0], str):
        return values[0]
    return None


def owner_pod(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(name, uid) of the owning Pod: the ownerReference of kind Pod, else spec.podName."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1":
            return ref.get("name"), ref.get("uid")
    spec = body.get(SPEC) or {}
    return ENDPOINT_FIELDS.pod_name.get(spec), ENDPOINT_FIELDS.pod_uid.get(spec) or None


def is_exempt(userinfo: Mapping[str, Any], exempt_users: Iterable[str] = ()) -> bool:
    user = str(userinfo.get("username") or "")
    groups = set(userinfo.get("groups") or ())
    return (bool(groups & ADMIN_GROUPS) or user in set(exempt_users)
            or user in CONTROLLER_USERS or user.startswith(CONTROLLER_SA_PREFIX))


def check_pod_identity(body: Mapping[str, Any], userinfo: Mapping[str, Any] | None, *,
                       exempt_users: Iterable[str] = ()) -> list[str]:
    """Messages (empty = admitted) for a KVEndpoint CREATE/UPDATE by ``userinfo``.

    ``userinfo`` is the AdmissionReview ``request.userInfo`` (username, groups, extra).
    """
    userinfo = userinfo or {}
    if is_exempt(userinfo, exempt_users):
        return []
    user = userinfo.get("username") or "<unknown>"
    requester = _extra(userinfo, POD_NAME_EXTRA)
    if requester is None:
        return [f"metadata.ownerReferences: KVEndpoints are written by the agent of their own "
                f"pod with a pod-bound ServiceAccount token; {user} presented no "
                f"{POD_NAME_EXTRA} (use a projected or --bound-object-kind Pod token)"]
    name, uid = owner_pod(body)
    errors = []
    if name != requester:
        errors.append(f"metadata.ownerReferences: owner Pod {name!r} is not the requesting pod "
                      f"{requester!r} ({user}); a pod may only publish its own KVEndpoint")
    spec_pod = ENDPOINT_FIELDS.pod_name.get(body.get(SPEC))
    if spec_pod is not None and spec_pod != requester:
        errors.append(f"spec.podName: expected the requesting pod {requester!r}, got {spec_pod!r}")
    req_uid = _extra(userinfo, POD_UID_EXTRA)
    if name == requester and req_uid and uid and uid != req_uid:
        errors.append(f"metadata.ownerReferences: owner Pod uid {uid!r} is not the requesting "
                      f"pod's uid {req_uid!r} (a pod of the same name from an earlier life?)")
    return errors
