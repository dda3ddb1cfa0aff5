"""What an engine says it serves (issue #35): the revision, the identity read from a vLLM
config (``kvbridge_model_digest`` refused when wrong), and the KVEndpoint document carrying
it, parsed back by the operator."""

from __future__ import annotations

import logging
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvbridge_agent import __version__
from kvbridge_agent._testmodel import write_test_model
from kvbridge_agent.identity import (
    ModelIdentity,
    _model,
    _revision,
    fingerprint,
    identify_model,
    model_revision,
    snapshot_commit,
)
from kvbridge_agent.kube import endpoint_spec
from kvbridge_agent.resources import ENDPOINT_FIELDS
from kvbridge_agent.service import EngineInfo
from kvbridge_agent.vllm._errors import UnsupportedVllmSettingError
from kvbridge_agent.vllm._model import model_digest, served_model_name, vllm_model_identity
from kvbridge_operator.spec import parse_endpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CRD = Path(__file__).resolve().parents[2] / "crds" / "kvbridge.io_kvendpoints.yaml"


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A Hugging Face cache layout holding the test model at one commit."""
    return write_test_model(tmp_path / "models--org--tiny" / "snapshots" / COMMIT)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_revision, "_warned", set())


def vllm_config(model: str, *, served: object = None, revision: str | None = None
                ) -> SimpleNamespace:  # fmt: skip
    """The parts of a vLLM config the identity reads (``model_config``)."""
    return SimpleNamespace(model_config=SimpleNamespace(
        model=model, served_model_name=served, revision=revision))


# -- revision -----------------------------------------------------------------------------------

def test_revision_from_a_snapshot_path(snapshot: Path, tmp_path: Path) -> None:
    assert snapshot_commit(snapshot) == COMMIT
    assert snapshot_commit(snapshot / "config.json") == COMMIT
    link = tmp_path / "served"
    link.symlink_to(snapshot)
    assert model_revision(str(link)) == COMMIT            # resolved through the link
    assert model_revision(str(snapshot), "v2.1") == "v2.1"   # --revision wins
    assert model_revision(str(tmp_path)) == ""
    assert snapshot_commit(tmp_path / "snapshots" / "main") == ""   # not a commit


# -- the identity ---------------------------------------------------------------------------------

def test_identity_of_a_snapshot(snapshot: Path) -> None:
    ident = identify_model("tiny", str(snapshot), vllm_version="0.30.0")
    assert ident == ModelIdentity("tiny", COMMIT, fingerprint(snapshot).value, "0.30.0",
                                  __version__)
    assert identify_model("tiny", str(snapshot), digest="full").fingerprint == \
        fingerprint(snapshot, "full").value
    assert identify_model("tiny", str(snapshot), digest="off").fingerprint == ""


def test_identity_fields_are_the_endpoint_table_attrs() -> None:
    fields = ModelIdentity("n" * 300, "r", "sampled-v1:" + "0" * 64, "v", "k").fields()
    attrs = {f.attr for f in ENDPOINT_FIELDS}
    assert set(fields) <= attrs and set(fields) == {
        "model_name", "model_revision", "model_fingerprint", "vllm_version", "kvbridge_version"}
    assert len(fields["model_name"]) == 253


def test_a_repository_id_without_huggingface_hub_publishes_no_fingerprint(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # import fails
    with caplog.at_level(logging.WARNING, "kvbridge.identity"):
        for _ in range(3):
            ident = identify_model("org/tiny", "org/tiny")
    assert (ident.fingerprint, ident.revision) == ("", "")
    assert len([r for r in caplog.records if "huggingface_hub" in r.getMessage()]) == 1


def test_a_repository_id_resolves_to_its_cached_snapshot(
        snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, object, object]] = []

    def snapshot_download(repo_id: str, revision: object = None,
                          local_files_only: object = False) -> str:
        asked.append((repo_id, revision, local_files_only))
        return str(snapshot)

    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    ident = identify_model("tiny", "org/tiny")
    assert asked == [("org/tiny", None, True)]                 # never a download
    assert (ident.revision, ident.fingerprint) == (COMMIT, fingerprint(snapshot).value)


def test_a_repository_id_not_cached_publishes_no_fingerprint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hub = types.ModuleType("huggingface_hub")

    def snapshot_download(*args: object, **kwargs: object) -> str:
        raise FileNotFoundError("not in the cache")

    hub.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    assert identify_model("tiny", "org/tiny", "abc").fingerprint == ""


# -- the vLLM setting -----------------------------------------------------------------------------

def test_model_digest_setting() -> None:
    assert model_digest({}) == "sampled"
    assert [model_digest({"kvbridge_model_digest": m}) for m in ("sampled", "full", "off")] \
        == ["sampled", "full", "off"]
    for bad in ("sha256", "FULL", True, None, ["full"]):
        with pytest.raises(UnsupportedVllmSettingError) as err:
            model_digest({"kvbridge_model_digest": bad})
        assert "kv_connector_extra_config.kvbridge_model_digest" in str(err.value)
        assert "'sampled', 'full', 'off'" in str(err.value)


def test_identity_from_a_vllm_config(snapshot: Path) -> None:
    cfg = vllm_config(str(snapshot), served=["tiny", "alias"])
    ident = vllm_model_identity(cfg, {}, "0.30.0")
    assert (ident.name, ident.revision, ident.vllm_version) == ("tiny", COMMIT, "0.30.0")
    assert ident.fingerprint == fingerprint(snapshot).value
    off = vllm_model_identity(vllm_config(str(snapshot), revision="v1"),
                              {"kvbridge_model_digest": "off"}, "0.30.0")
    assert (off.name, off.revision, off.fingerprint) == (str(snapshot), "v1", "")
    assert served_model_name(SimpleNamespace(model="m", served_model_name=[])) == "m"
    with pytest.raises(UnsupportedVllmSettingError):
        vllm_model_identity(cfg, {"kvbridge_model_digest": "md5"}, "0.30.0")


def test_an_unreadable_model_file_does_not_stop_the_engine(
        snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_read(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_model, "fingerprint", failing_read)   # a disk error mid-read
    ident = vllm_model_identity(vllm_config(str(snapshot)), {}, "0.30.0")
    assert ident.fingerprint == "" and ident.revision == COMMIT


# -- the KVEndpoint -------------------------------------------------------------------------------

def _service() -> SimpleNamespace:
    """What endpoint_spec reads of a started agent (its engine facts and registration)."""
    metadata = SimpleNamespace(
        region_names=["l0"], region_num_blocks=[64], region_group_ids=[0],
        region_mem_types=["DRAM"], block_lens=[4096], block_strides=[4096], num_blocks=64)
    return SimpleNamespace(engine=EngineInfo("E", "decode"), metadata=metadata,
                           advertise_host="10.0.0.1", port=5600, hash="ab" * 32, epoch=3)


def test_the_endpoint_document_carries_the_identity(snapshot: Path) -> None:
    ident = identify_model("tiny", str(snapshot), vllm_version="0.30.0")
    spec = endpoint_spec(_service(), transfer="kvt", pod_name="d-0", identity=ident)
    assert spec["model"] == {"name": "tiny", "revision": COMMIT,
                             "fingerprint": ident.fingerprint}
    assert spec["versions"] == {"vllm": "0.30.0", "kvbridge": __version__}
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]
    props = schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]["properties"]
    assert re.fullmatch(props["fingerprint"]["pattern"], spec["model"]["fingerprint"])
    ep = parse_endpoint({"metadata": {"name": "d-0-tp0", "namespace": "ns"}, "spec": spec})
    assert (ep.model_name, ep.model_fingerprint) == ("tiny", ident.fingerprint)


def test_without_an_identity_the_document_has_none() -> None:
    spec = endpoint_spec(_service(), transfer="kvt", pod_name="d-0")
    assert "model" not in spec and "versions" not in spec
    spec = endpoint_spec(_service(), transfer="kvt", pod_name="d-0",
                         identity=ModelIdentity(name="tiny", kvbridge_version="0.1.0"))
    assert spec["model"] == {"name": "tiny"} and spec["versions"] == {"kvbridge": "0.1.0"}
