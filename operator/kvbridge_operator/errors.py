"""Operator errors. Handlers map them to kopf errors; nothing else imports kopf for them."""

from __future__ import annotations


class SpecError(ValueError):
    """A custom resource field is malformed: ``path`` names it, the message says what to do."""

    def __init__(self, path: str, expected: str, actual: object) -> None:
        super().__init__(f"{path}: expected {expected}, got {actual!r}")
        self.path = path
        self.expected = expected
        self.actual = actual
