"""The one builder of the service's transfer requests (pull, start-pull, push), so the
default deadline and the field order live in one place."""

from __future__ import annotations

from collections.abc import Sequence

from ..nixl import PullRequest, PushRequest  # no NIXL build loads here

__all__ = ["RequestBuilder"]


class RequestBuilder:
    """Builds :class:`~..nixl.PullRequest` / :class:`~..nixl.PushRequest` with the agent's
    default deadline (``AgentSettings.transfer_timeout_s``) unless the call gives one."""

    __slots__ = ("default_timeout_s",)

    def __init__(self, default_timeout_s: float) -> None:
        self.default_timeout_s = float(default_timeout_s)

    def timeout(self, timeout_s: float | None) -> float:
        return self.default_timeout_s if timeout_s is None else float(timeout_s)

    def pull(
        self,
        request_id: str,
        remote_engine_id: str,
        local_block_ids: Sequence[Sequence[int]],
        remote_block_ids: Sequence[Sequence[int]],
        *,
        remote_request_id: str | None = None,
        timeout_s: float | None = None,
        num_computed_blocks: Sequence[int] | None = None,
        remote_num_tokens: int | None = None,
    ) -> PullRequest:
        return PullRequest(request_id, remote_engine_id, local_block_ids, remote_block_ids,
                           remote_request_id, self.timeout(timeout_s), num_computed_blocks,
                           remote_num_tokens)

    def push(
        self,
        request_id: str,
        remote_engine_id: str,
        local_block_ids: Sequence[Sequence[int]],
        remote_block_ids: Sequence[Sequence[int]],
        *,
        timeout_s: float | None = None,
    ) -> PushRequest:
        return PushRequest(request_id=request_id, remote_engine_id=remote_engine_id,
                           local_block_ids=local_block_ids, remote_block_ids=remote_block_ids,
                           timeout_s=self.timeout(timeout_s))
