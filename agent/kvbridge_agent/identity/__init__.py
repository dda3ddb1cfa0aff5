"""The model an engine serves, as its KVEndpoint states it (issue #35).

The compatibility hash covers a model's name, dtype and shapes, not its weights: a prefill
and a decode that load different weights under one name would pair and answer wrong
tokens. This package works out what the endpoint publishes so that the operator can tell
them apart: the served name, the revision, a content fingerprint of the model's files
(:mod:`._fingerprint` says what each mode detects) and the software versions. Pure: no vLLM,
NIXL or Kubernetes imports (``huggingface_hub`` only if installed, to find a cached model).
"""

from ._exchange import (
    EXCHANGE_VERSION,
    MARKER_KEY,
    Verdict,
    compare_identities,
    decode_identity,
    describe,
    encode_identity,
    encode_identity_request,
    is_identity_request,
)
from ._files import WEIGHT_SUFFIXES, ModelFile, is_model_file, model_files
from ._fingerprint import MODES, Fingerprint, fingerprint, sample_offsets
from ._model import DIGEST_MODES, ModelIdentity, identify_model
from ._revision import local_model_dir, model_revision, snapshot_commit

__all__ = [
    "DIGEST_MODES",
    "EXCHANGE_VERSION",
    "MARKER_KEY",
    "MODES",
    "WEIGHT_SUFFIXES",
    "Fingerprint",
    "ModelFile",
    "ModelIdentity",
    "Verdict",
    "compare_identities",
    "decode_identity",
    "describe",
    "encode_identity",
    "encode_identity_request",
    "fingerprint",
    "identify_model",
    "is_identity_request",
    "is_model_file",
    "local_model_dir",
    "model_files",
    "model_revision",
    "sample_offsets",
    "snapshot_commit",
]
