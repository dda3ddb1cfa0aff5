"""The agent labels its KVEndpoint with its pod's labels, read from a downwardAPI file, so
that KVTransfer selectors match vLLM pods (whose connector has no other way to know them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge_agent.kube._identity import PodIdentity, PodLabelsError, parse_pod_labels

ENV = {"POD_NAME": "p-0", "POD_UID": "u-0", "POD_NAMESPACE": "ns", "POD_IP": "10.0.0.5"}
# What the kubelet writes for metadata.labels (keys sorted, values quoted).
DOWNWARD = ('app.kubernetes.io/name="tiny-llama"\nkvbridge.io/agent="true"\n'
            'kvbridge.io/role="decode"\npod-template-hash="6ff8f94469"')


def test_downward_api_format_is_parsed() -> None:
    assert parse_pod_labels(DOWNWARD) == {
        "app.kubernetes.io/name": "tiny-llama", "kvbridge.io/agent": "true",
        "kvbridge.io/role": "decode", "pod-template-hash": "6ff8f94469"}
    assert parse_pod_labels("") == {}
    assert parse_pod_labels('empty=""\n\n') == {"empty": ""}


@pytest.mark.parametrize("bad", ["novalue", 'k=unquoted', '="v"', 'k="open'])
def test_malformed_line_is_named(bad: str) -> None:
    with pytest.raises(PodLabelsError, match=r"f, line 2: expected key=\"value\""):
        parse_pod_labels(f'ok="1"\n{bad}', "f")


def test_identity_reads_labels_from_the_file(tmp_path: Path) -> None:
    labels = tmp_path / "labels"
    labels.write_text(DOWNWARD)
    pod = PodIdentity.from_env({**ENV, "KVBRIDGE_POD_LABELS_FILE": str(labels)})
    assert (pod.name, pod.uid, pod.namespace, pod.pod_ip) == ("p-0", "u-0", "ns", "10.0.0.5")
    assert pod.labels["kvbridge.io/role"] == "decode"


def test_identity_without_the_file_has_no_labels(tmp_path: Path) -> None:
    pod = PodIdentity.from_env({**ENV, "KVBRIDGE_POD_LABELS_FILE": str(tmp_path / "none")})
    assert pod.labels == {}


def test_identity_reads_the_serving_port(tmp_path: Path) -> None:
    none = {**ENV, "KVBRIDGE_POD_LABELS_FILE": str(tmp_path / "none")}
    assert PodIdentity.from_env(none).serving_port == 0
    assert PodIdentity.from_env({**none, "KVBRIDGE_SERVING_PORT": "8000"}).serving_port == 8000


@pytest.mark.parametrize("bad", ["http", "0", "70000", "-1"])
def test_a_bad_serving_port_is_named(tmp_path: Path, bad: str) -> None:
    env = {**ENV, "KVBRIDGE_POD_LABELS_FILE": str(tmp_path / "none"), "KVBRIDGE_SERVING_PORT": bad}
    with pytest.raises(ValueError, match=r"KVBRIDGE_SERVING_PORT: expected a TCP port .* got"):
        PodIdentity.from_env(env)


def test_each_tp_rank_of_a_pod_gets_its_own_endpoint_name() -> None:
    pod = PodIdentity("vllm-decode-0", "uid-1", "serving")
    assert pod.endpoint_name() == pod.endpoint_name(0, 1) == "vllm-decode-0"
    assert [pod.endpoint_name(r, 2) for r in (0, 1)] == ["vllm-decode-0-tp0",
                                                         "vllm-decode-0-tp1"]
