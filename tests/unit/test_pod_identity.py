"""The pod-identity admission rule (owner Pod == the pod bound in the requester's token)."""

from __future__ import annotations

from kvbridge_operator.pod_identity import POD_NAME_EXTRA, POD_UID_EXTRA, check_pod_identity

SA = "system:serviceaccount:ns:kvbridge-agent"


def body(pod: str = "p-0", uid: str = "u0", spec_pod: str | None = None) -> dict:
    return {"metadata": {"name": pod, "ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}]},
        "spec": {"podName": spec_pod or pod}}


def user(pod: str | None = "p-0", uid: str | None = "u0", name: str = SA,
         groups: tuple[str, ...] = ("system:serviceaccounts",)) -> dict:
    extra = {}
    if pod is not None:
        extra[POD_NAME_EXTRA] = [pod]
    if uid is not None:
        extra[POD_UID_EXTRA] = [uid]
    return {"username": name, "groups": list(groups), "extra": extra}


def test_own_pod_is_admitted() -> None:
    assert check_pod_identity(body(), user()) == []


def test_other_pods_endpoint_is_rejected_naming_both_pods() -> None:
    errors = check_pod_identity(body("p-1", "u1"), user("p-0", "u0"))
    assert errors and "'p-1'" in errors[0] and "'p-0'" in errors[0]


def test_spec_pod_name_must_match_too() -> None:
    errors = check_pod_identity(body("p-0", spec_pod="p-9"), user())
    assert any(e.startswith("spec.podName") for e in errors)


def test_uid_mismatch_is_rejected() -> None:
    errors = check_pod_identity(body(uid="old"), user(uid="new"))
    assert any("uid" in e for e in errors)


def test_another_pods_endpoint_is_not_blamed_on_an_earlier_life() -> None:
    errors = check_pod_identity(body(pod="p-1", uid="u1"), user(pod="p-0", uid="u0"))
    assert errors and not any("earlier life" in e for e in errors)


def test_token_without_pod_binding_is_rejected() -> None:
    errors = check_pod_identity(body(), user(pod=None, uid=None))
    assert errors and "pod-bound" in errors[0]
    assert check_pod_identity(body(), None)


def test_admins_operator_and_controllers_are_exempt() -> None:
    assert check_pod_identity(body(), user(None, None, "admin", ("system:masters",))) == []
    op = "system:serviceaccount:kvbridge-system:kvbridge-operator"
    assert check_pod_identity(body(), user(None, None, op), exempt_users=[op]) == []
    assert check_pod_identity(body(), user(None, None, op)) != []
    gc = "system:serviceaccount:kube-system:generic-garbage-collector"
    assert check_pod_identity(body(), user(None, None, gc)) == []


def test_string_extra_values_and_spec_fallback() -> None:
    u = {"username": SA, "groups": [], "extra": {POD_NAME_EXTRA: "p-0"}}
    assert check_pod_identity({"spec": {"podName": "p-0"}}, u) == []
    assert check_pod_identity({"spec": {"podName": "p-1"}}, u)
