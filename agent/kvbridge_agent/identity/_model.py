"""What a KVEndpoint says about the model its engine serves (``spec.model``,
``spec.versions``), and how an engine works it out at start-up.

The operator pairs a prefill and a decode only when their fingerprints are equal: equal
compatibility hashes say the KV has the same shape, equal fingerprints that it was computed
by the same numbers. The versions are there for people reading a rollout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ._fingerprint import MODES, fingerprint
from ._revision import local_model_dir, model_revision, warn_once

__all__ = ["DIGEST_MODES", "ModelIdentity", "identify_model"]

log = logging.getLogger("kvbridge.identity")

#: The choices of the connector's ``kvbridge_model_digest``: a fingerprint mode, or none.
DIGEST_MODES = (*MODES, "off")

#: The CRD's bounds of the string fields (longer values would be refused by the apiserver).
_MAX_LEN = {"model_name": 253, "model_revision": 128, "vllm_version": 64,
            "kvbridge_version": 64}


@dataclass(frozen=True)
class ModelIdentity:
    """The model an engine serves and the software serving it; empty strings are unknown
    and left out of the KVEndpoint."""

    name: str = ""
    revision: str = ""
    fingerprint: str = ""
    vllm_version: str = ""
    kvbridge_version: str = ""

    def fields(self) -> dict[str, str]:
        """The values by the KVEndpoint field table's attributes (``model_name``, ...), each
        cut to its CRD bound (a served name longer than 253 characters would otherwise make
        the apiserver refuse the whole endpoint)."""
        values = {"model_name": self.name, "model_revision": self.revision,
                  "model_fingerprint": self.fingerprint, "vllm_version": self.vllm_version,
                  "kvbridge_version": self.kvbridge_version}
        return {k: v[:_MAX_LEN[k]] if k in _MAX_LEN else v for k, v in values.items()}


def identify_model(name: str, model: str, revision: str | None = None, *,
                   digest: str = "sampled", vllm_version: str = "",
                   kvbridge_version: str | None = None) -> ModelIdentity:
    """Work out the identity of ``model`` (a path or a repository id) served as ``name``.

    ``digest`` is a :data:`DIGEST_MODES` choice. A model with no local directory, or one
    holding none of the model's files (weights streamed from object storage, say), gets an
    empty fingerprint and one warning: the engine still starts, and the operator pairs it
    only with endpoints that have no fingerprint either. Logs the identity and the time the
    fingerprint took at INFO.

    Raises:
        ValueError: ``digest`` is not one of :data:`DIGEST_MODES`.
        OSError: a model file cannot be read.
    """
    if digest not in DIGEST_MODES:
        raise ValueError(f"model digest {digest!r}: expected one of {list(DIGEST_MODES)}")
    if kvbridge_version is None:
        from .. import __version__ as kvbridge_version
    local = local_model_dir(model, revision)
    value = ""
    if digest != "off" and local is not None:
        fp = fingerprint(local, digest)
        if fp.files:
            value = fp.value
            log.info("kvbridge: model fingerprint %s of %s: %d files, %d bytes read in "
                     "%.3f s", value, local, fp.files, fp.bytes_read, fp.seconds)
        else:
            warn_once(f"empty:{local}", "kvbridge: %s holds no weight, tokenizer or config "
                      "file: publishing no model fingerprint", local)
    identity = ModelIdentity(
        name=str(name), revision=model_revision(model, revision, local),
        fingerprint=value, vllm_version=str(vllm_version),
        kvbridge_version=str(kvbridge_version))
    log.info("kvbridge: serving model %r revision %r fingerprint %r (digest %s; vLLM %s, "
             "kvbridge %s)", identity.name, identity.revision or "-",
             identity.fingerprint or "-", digest, identity.vllm_version or "-",
             identity.kvbridge_version)
    return identity

