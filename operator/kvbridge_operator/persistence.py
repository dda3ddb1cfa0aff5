"""Where kopf keeps its bookkeeping on KVTransfers: progress in small annotations, and no
diff base.

kopf's default diff base is a copy of the object's spec, labels and annotations in an
annotation of its own, written after each handled change. The apiserver caps an object's
annotations at 256 KiB in total, so on a KVTransfer with a large spec or large annotations
that patch is refused, and the finalizer removal that kopf sends in the same patch with it:
the KVTransfer stays Terminating forever. kvbridge has no handler that compares an object
with its last handled version (only ``on.delete``, a daemon, indexes and event handlers), so
it keeps no diff base at all; kopf then sees every change as a creation, for which nothing is
registered. The copy left by earlier versions is removed from each object it is found on.
"""

from __future__ import annotations

from typing import Any

import kopf

from .config import ANNOTATION_PREFIX

DIFFBASE_KEY = "last-handled-configuration"


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """A diff base that is never stored (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(prefix=ANNOTATION_PREFIX, key=DIFFBASE_KEY)

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        annotations = body.metadata.annotations
        for key in self.make_keys(self.key, body=body):
            if key in annotations:
                patch.metadata.annotations[key] = None


def configure(settings: kopf.OperatorSettings) -> None:
    """Progress in ``kvbridge.io/<handler>`` annotations (a few hundred bytes, removed when
    the handler is done), no diff base."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = NoDiffBase()
