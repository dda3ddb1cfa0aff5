"""Kubernetes' syntax rules for the fields that name Kubernetes things (label keys and values,
object names, hosts), as the webhook applies them."""

from __future__ import annotations

import pytest

from kvbridge_operator import admission, syntax
from kvbridge_operator import testing as T


@pytest.mark.parametrize(("key", "ok"), [
    ("app", True), ("kvbridge.io/role", True), ("topology.kubernetes.io/zone", True),
    ("a" * 63, True), ("a" * 64, False), ("-app", False), ("app-", False), ("a b", False),
    ("/app", False), ("Example.com/app", False), ("x/", False), ("", False),
    ("a" * 254 + "/app", False),
])
def test_label_keys(key, ok):
    assert (syntax.label_key(key) is None) is ok


@pytest.mark.parametrize(("name", "ok"), [
    ("kvt", True), ("decode-0.a", True), ("a" * 63, True), ("a" * 64, False),
    (".".join(["a" * 63] * 4), False), ("Decode", False), ("a_b", False), ("", False),
])
def test_object_names(name, ok):
    assert (syntax.dns_subdomain(name) is None) is ok


@pytest.mark.parametrize(("host", "ok"), [
    ("10.0.3.7", True), ("fd00::1", True), ("prefill-0.prefill.ns.svc", True),
    ("Prefill-0.Example.com", True), ("10.0.3.7:5600", False), ("[fd00::1]", False),
    ("host name", False), ("999.1.1.1", False), ("", False),
])
def test_hosts(host, ok):
    assert (syntax.host(host) is None) is ok


def test_a_port_in_the_host_points_at_the_port_field():
    assert "spec.sideChannel.port" in (syntax.host("pod:5600") or "")


def test_endpoint_references_are_checked_with_the_field_and_value():
    body = T.endpoint_manifest("d0", role="decode", engine_id="e")
    body["spec"]["sideChannel"]["host"] = "10.0.0.1:80"
    (error,) = admission.check_endpoint(body)
    assert error.startswith("spec.sideChannel.host: expected an IP address or a DNS name")
    assert error.endswith("got '10.0.0.1:80'")


def test_selector_label_keys_are_checked_one_by_one():
    body = T.transfer_manifest("t")
    body["spec"]["prefill"]["selector"] = {
        "matchLabels": {"ok": "fine", "bad key": "x"},
        "matchExpressions": [{"key": "zone", "operator": "Exists"},
                             {"key": "a/b/c", "operator": "Exists"}]}
    errors = admission.check_transfer(body)
    assert errors == [
        "spec.prefill.selector.matchLabels['bad key']: expected a label key ([prefix/]name, "
        "name at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric), "
        "got 'bad key'",
        "spec.prefill.selector.matchExpressions[1].key: expected a label key whose prefix "
        "before '/' is a DNS subdomain (lowercase alphanumerics, '-' and '.', at most 253 "
        "characters), got 'a/b/c'"]
    assert admission.check_transfer(T.transfer_manifest("t")) == []
