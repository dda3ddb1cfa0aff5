"""vLLM's worker-side connector contract, carried out by kvbridge's agent.

vLLM's ``NixlBaseConnector`` facade forwards worker calls to ``connector_worker``; this
class is that worker. Per engine step:

- ``start_load_kv(metadata)``: pulls for ``reqs_to_recv`` (after an on-demand handshake in
  the background if the remote is not loaded yet, none if the operator's preflight loaded
  it), each declined instead when the prefill's stated lease deadline has passed
  (:mod:`._lease`) or a kvbridge prefill serves another model (:mod:`._peer_models`; the
  request then follows ``kv_load_failure_policy``), lease bookkeeping for
  ``reqs_in_batch`` / ``reqs_to_send`` (the prefill side), and the heartbeats;
- ``get_transfer_results()``: finished and failed receives and the requests whose blocks
  may be freed (every consumer notified, or the lease expired), in vLLM's terms. A failed
  pull never notifies the producer; for models without the hybrid allocator its blocks
  are reported as load errors so ``kv_load_failure_policy`` applies.

In a pod with the downward-API variables the agent also publishes its KVEndpoint and
follows the operator's peers (:class:`~kvbridge_agent.kube.EndpointSync`). Without an
operator, ``kv_connector_extra_config.kvbridge_peers`` (a list of ``{"engine_id", "host",
"port", "tp_size"}``) names prefill engines to preflight at start-up, retried until they
answer, so that their first request pays no handshake either.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import vllm
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    NixlHandshakePayload,
    ReqMeta,
)

from .. import env as names
from .. import metrics
from ..geometry import handshake_target_ranks
from ..resources import HANDSHAKE_TIMEOUT_S, ROLES, TRANSFER_TIMEOUT_S
from ..service import AgentService, AgentSettings, EngineInfo, PeerRef
from ._facts import UnsupportedVllmSettingError as _Refused
from ._facts import VllmEngineFacts, read_engine_facts, static_peer
from ._layers import LayerCache, layer_views
from ._lease import (
    DEFAULT_LEASE_MARGIN_S,
    HeartbeatLog,
    ReadDecision,
    decide_read,
    read_deadline,
)
from ._model import vllm_model_identity
from ._peer_models import PeerModels
from ._scheduler import IDENTITY_PEERS_ATTR, LEASE_EXTENSIONS_ATTR

if TYPE_CHECKING:
    from ..kube import PodDuties

__all__ = ["KVBridgeWorker"]

log = logging.getLogger("kvbridge.vllm")

#: Transfer failures that say nothing about the peer (the request itself was wrong).
_REQUEST_FAULTS = frozenset({"invalid_request", "unsupported"})


@dataclass(frozen=True)
class _Handshake:
    engine_id: str
    ok: bool
    message: str = ""


class KVBridgeWorker:
    """The worker half of :class:`~kvbridge_agent.vllm.KVBridgeConnector` (one TP rank)."""

    # Attributes vLLM's facade reads: no PCP, no host staging buffer.
    pcp_rank = 0
    pcp_dcp_sharded = False
    use_host_buffer = False
    copy_blocks = None

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        self.facts: VllmEngineFacts = read_engine_facts(vllm_config, engine_id, kv_cache_config)
        extra = self.facts.extra
        self.role = os.environ.get(names.ROLE) or self.facts.role
        if self.role not in ROLES:
            raise _Refused(f"KVBRIDGE_ROLE={self.role!r}: expected 'prefill' or 'decode'")
        if self.facts.kv_role == "kv_producer" and self.role == "decode":
            raise _Refused(
                "KVBRIDGE_ROLE='decode' with kv_role='kv_producer': a producer never pulls; "
                "use kv_role 'kv_consumer' or 'kv_both'")
        self.transfer_timeout_s = float(
            extra.get("kvbridge_transfer_timeout_s", TRANSFER_TIMEOUT_S))
        self.handshake_timeout_s = float(
            extra.get("kvbridge_handshake_timeout_s", HANDSHAKE_TIMEOUT_S))
        self.lease_s = float(extra.get("kv_lease_duration", 30))
        self.lease_margin_s = float(extra.get("kvbridge_lease_margin_s", DEFAULT_LEASE_MARGIN_S))
        if self.lease_s <= 0 or self.lease_margin_s < 0:
            raise _Refused(
                f"kv_lease_duration={self.lease_s}, kvbridge_lease_margin_s="
                f"{self.lease_margin_s}: expected a lease > 0 and a margin >= 0 (seconds)")
        self.enforce_hash = bool(extra.get("enforce_handshake_compat", True))
        # vLLM's NIXL worker reads the same key with the same default (UCX worker threads)
        self.nixl_threads = int(extra.get("num_threads", 4))
        self.service: AgentService | None = None
        self.duties: PodDuties | None = None
        self.kv_caches: dict[str, Any] = {}
        self.xfer_handshake_metadata: NixlHandshakePayload | None = None
        self._recving: dict[str, ReqMeta] = {}        # reported when their pull ends
        self._awaiting_handshake: dict[str, list[tuple[str, ReqMeta]]] = {}
        #: finished handshakes, from the handshake thread (deque: thread-safe, no lock)
        self._handshakes: deque[_Handshake] = deque()
        self._handshaking: set[str] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-handshake")
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()
        self._held: set[str] = set()                  # prefill side: requests in a batch
        #: decode side: heartbeats sent per remote request, and the lease extension each
        #: prefill stated, until the request's read starts
        self._heartbeats = HeartbeatLog()
        self._extensions: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.static_peers = [static_peer(p) for p in extra.get("kvbridge_peers") or ()]
        #: what the KVEndpoint says this engine serves (kvbridge_model_digest)
        self.identity = vllm_model_identity(vllm_config, extra, vllm.__version__)
        self.models = PeerModels(self.identity, self.handshake_timeout_s)   # kvbridge peers'

    # -- registration ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register the caches vLLM allocated and build the v11 payload vLLM's scheduler
        serves; publish the KVEndpoint when running in a pod."""
        f = self.facts
        layers = [LayerCache(name, tensor, spec.group_id, spec.page_bytes, spec.num_blocks,
                             spec.is_mla, spec.host_resident)
                  for name, tensor in kv_caches.items()
                  if (spec := f.layers.get(name)) is not None]
        if not layers:
            raise _Refused(
                "KVBridgeConnector: no KV cache layer to register (no attention layers?)")
        env = os.environ
        host = envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        settings = AgentSettings(
            side_channel_host=host, side_channel_port=int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT),
            advertise_host=env.get(names.POD_IP) or host,
            handshake_timeout_s=self.handshake_timeout_s,
            transfer_timeout_s=self.transfer_timeout_s, enforce_hash=self.enforce_hash,
            serve_side_channel=False, progress_thread=False, nixl_threads=self.nixl_threads,
            lease_s=self.lease_s,
            producer_too=f.kv_role == "kv_both" and self.role == "decode")
        info = EngineInfo(
            f.engine_id, self.role, tp_rank=f.tp_rank, tp_size=f.tp_size, dp_index=f.dp_index,
            block_size=f.block_size, ppl=f.ppl, num_blocks=f.num_blocks,
            kv_cache_layout=f.kv_cache_layout, attn_backend_name=f.attn_backend_name,
            is_mla=f.is_mla, num_kv_heads=f.num_kv_heads, mode="pull")
        self.service = AgentService(layer_views(layers), info, f.compat_hash, settings).start()
        self.kv_caches = dict(kv_caches)
        payload = self.service.payload
        self.xfer_handshake_metadata = NixlHandshakePayload(
            compatibility_hash=payload.compatibility_hash,
            agent_metadata_bytes=payload.agent_metadata_bytes)
        self._start_kubernetes_duties()
        if self.static_peers:
            threading.Thread(target=self._preflight_static_peers, daemon=True,
                             name="kvbridge-preflight").start()

    def _preflight_static_peers(self) -> None:
        """Handshake with every configured peer until each has answered once."""
        backoff = 0.5
        todo = list(self.static_peers)
        while todo and not self._stop.is_set():
            svc = self.service
            if svc is None:
                return
            for peer in list(todo):
                if svc.has_remote(peer["engine_id"]):
                    todo.remove(peer)
                    continue
                ok, message = self.preflight(**peer)
                if ok:
                    todo.remove(peer)
                else:
                    log.info("preflight of %s not done yet: %s", peer["engine_id"], message)
            if todo:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _start_kubernetes_duties(self) -> None:
        """Publish and follow this rank's KVEndpoint when the pod's identity is in the
        environment; serve agent metrics when ``KVBRIDGE_AGENT_METRICS_PORT`` is set (rank r
        on that port + r)."""
        from ..kube import EndpointPublisher, PodDuties, PodIdentity, api_client

        env = os.environ
        assert self.service is not None
        publisher, transfer = None, ""
        if names.in_pod(env):
            transfer = env.get(names.TRANSFER, "")
            if not transfer:
                raise _Refused(
                    f"{names.TRANSFER} is not set: in a pod ({names.POD_NAME} and "
                    f"{names.POD_UID} set) the connector publishes a KVEndpoint and needs the "
                    "name of its KVTransfer")
            pod = PodIdentity.from_env()
            if not pod.kv_events_port and self.facts.kv_events_port:
                pod = replace(pod, kv_events_port=self.facts.kv_events_port)
            if not pod.labels:
                log.warning("kvbridge: no pod labels (mount a downwardAPI item of "
                            f"metadata.labels at ${names.POD_LABELS_FILE}, default "
                            "/etc/podinfo/labels): the KVEndpoint carries none, so a "
                            "KVTransfer selector will not match it")
            publisher = EndpointPublisher(
                api_client(), pod, name=pod.endpoint_name(self.facts.tp_rank, self.facts.tp_size))
        port = names.metrics_port(env)
        if port:   # one port per TP rank: vLLM runs a pod's ranks as processes of their own
            port += self.facts.tp_rank
        self.duties = PodDuties.start(
            self.service, metrics_port=port, publisher=publisher,
            transfer=transfer, sync_interval_s=float(env.get(names.SYNC_INTERVAL_S, "1.0")),
            identity=self.identity)

    # -- the decode side: pulls ---------------------------------------------------------------
    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        svc = self._svc()
        self._drain_handshakes()
        self._extensions.update(getattr(metadata, LEASE_EXTENSIONS_ATTR, None) or {})
        marked = getattr(metadata, IDENTITY_PEERS_ATTR, None) or ()
        for req_id, meta in metadata.reqs_to_recv.items():
            remote = meta.remote
            assert remote is not None
            if meta.awaiting_kvs or any(meta.local_block_ids):
                self._recving[req_id] = meta
            if req_id in marked:   # a kvbridge prefill: its model is checked before a read
                self.models.mark(remote.engine_id)
            if svc.has_remote(remote.engine_id):
                self._start_pull(req_id, meta)
            else:
                self._awaiting_handshake.setdefault(remote.engine_id, []).append(
                    (req_id, meta))
                self._ensure_handshake(remote.engine_id, remote.host, remote.port,
                                       meta.tp_size)
        self._producer_bookkeeping(metadata)
        for engine_id, hb in metadata.heartbeat_by_engine.items():
            if svc.has_remote(engine_id):
                svc.send_heartbeat(engine_id, sorted(hb.req_ids))
                self._heartbeats.record(engine_id, hb.req_ids, time.perf_counter())
            else:
                self._ensure_handshake(engine_id, hb.host, hb.port, hb.tp_size)

    def _start_pull(self, req_id: str, meta: ReqMeta) -> None:
        remote = meta.remote
        assert remote is not None
        svc = self._svc()
        if not self.models.settled(remote.engine_id, svc.loaded_since(remote.engine_id)):
            self._awaiting_handshake.setdefault(remote.engine_id, []).append((req_id, meta))
            return self._ensure_handshake(remote.engine_id, remote.host, remote.port,
                                          meta.tp_size)
        extension = self._extensions.pop(req_id, None)
        sent = self._heartbeats.take(remote.engine_id, remote.request_id)
        if self.models.declines(remote.engine_id, req_id):
            self._failed.add(req_id)   # as a late read: kv_load_failure_policy applies
            return
        timeout = None
        if remote.blocks_expiry_time is not None and any(meta.local_block_ids):
            decision = self._lease_decision(req_id, meta, extension, sent)
            if decision is None:
                return
            if decision.heartbeat:   # the prefill then holds the blocks until the read ends
                svc.send_heartbeat(remote.engine_id, [remote.request_id])
            timeout = decision.timeout_s
        svc.start_pull(
            req_id, remote.engine_id, meta.local_block_ids, remote.block_ids,
            remote_request_id=remote.request_id,
            num_computed_blocks=list(meta.local_num_computed_blocks) or None,
            remote_num_tokens=remote.num_tokens, timeout_s=timeout)

    def _lease_decision(self, req_id: str, meta: ReqMeta, extension: float | None,
                        heartbeats: list[float]) -> ReadDecision | None:  # fmt: skip
        """How to read when the prefill's lease leaves time for it; None after declining
        the read (the request fails, and its load-failure policy applies)."""
        remote = meta.remote
        assert remote is not None and remote.blocks_expiry_time is not None
        clock = self._svc().clock_offset(remote.engine_id)
        now = time.perf_counter()
        if clock is None:
            why, left = "its clock offset is unknown (no handshake sample)", float("nan")
        else:
            deadline = read_deadline(clock.to_local(float(remote.blocks_expiry_time)),
                                     heartbeats, extension, self.lease_margin_s)
            decision = decide_read(now, deadline, margin_s=self.lease_margin_s,
                                   clock_error_s=clock.error_s, extension_s=extension,
                                   transfer_timeout_s=self.transfer_timeout_s)
            if decision.read:
                return decision
            left = decision.left_s
            why = (f"{left:.3f} s of its lease left, under the margin of "
                   f"{self.lease_margin_s + clock.error_s:.3f} s (kvbridge_lease_margin_s "
                   f"{self.lease_margin_s} + clock error {clock.error_s:.6f})")
        metrics.LATE_READS.inc()
        metrics.READS_DECLINED.labels("late_read").inc()
        log.warning("declining the read of request %s from engine %s (remote request %s): "
                    "%s; its blocks may be freed or reused, so kv_load_failure_policy "
                    "applies", req_id, remote.engine_id, remote.request_id, why)
        self._failed.add(req_id)
        return None

    def _ensure_handshake(self, engine_id: str, host: str, port: int, tp_size: int) -> None:
        """Handshake with ``engine_id`` in the background (one at a time, as vLLM does)."""
        with self._lock:
            if engine_id in self._handshaking:
                return
            self._handshaking.add(engine_id)
        self._executor.submit(self._handshake, engine_id, host, int(port), int(tp_size))

    def preflight(self, engine_id: str, host: str, port: int, tp_size: int = 1
                  ) -> tuple[bool, str]:  # fmt: skip
        """Handshake with a prefill engine now, so its first request pays none; returns
        ``(ok, why not)``. The operator's peer assignments and ``kvbridge_peers`` do this."""
        result = self._handshake_now(engine_id, host, int(port), int(tp_size))
        return result.ok, result.message

    def _handshake(self, engine_id: str, host: str, port: int, tp_size: int) -> None:
        """Handshake unless loaded, then check the model of a kvbridge peer if due."""
        result = _Handshake(engine_id, True)
        if not self._svc().has_remote(engine_id):
            result = self._handshake_now(engine_id, host, port, tp_size)
        generation = self._svc().loaded_since(engine_id)   # a kvbridge peer: its model
        if result.ok and (why := self.models.check(engine_id, host, port, generation)):
            result = _Handshake(engine_id, False, why)
        with self._lock:
            self._handshaking.discard(engine_id)
        self._handshakes.append(result)

    def _handshake_now(self, engine_id: str, host: str, port: int, tp_size: int) -> _Handshake:
        """Handshake with every rank of ``engine_id`` this rank reads from."""
        svc, f = self._svc(), self.facts
        try:
            ranks = handshake_target_ranks(f.tp_rank, f.tp_size, tp_size)
            reports = [svc.handshake(PeerRef(f"{engine_id}-tp{r}", engine_id, host, port, r,
                                             tp_size, None, "prefill")) for r in ranks]
            bad = [r for r in reports if not r.ok]
            result = _Handshake(engine_id, not bad,
                                "; ".join(f"{r.peer}: {r.reason}: {r.message}" for r in bad))
        except Exception as exc:   # a wrong TP size, for instance: fail its requests
            result = _Handshake(engine_id, False, f"{type(exc).__name__}: {exc}")
        return result

    def _drain_handshakes(self) -> None:
        while self._handshakes:
            done = self._handshakes.popleft()
            waiting = self._awaiting_handshake.pop(done.engine_id, [])
            if done.ok:
                for req_id, meta in waiting:
                    self._start_pull(req_id, meta)
                continue
            log.warning("handshake with remote engine %s failed: %s; failing %d request(s)",
                        done.engine_id, done.message, len(waiting))
            for req_id, _ in waiting:
                self._failed.add(req_id)
                self._extensions.pop(req_id, None)

    # -- the prefill side: leases -------------------------------------------------------------
    def _producer_bookkeeping(self, metadata: NixlConnectorMetadata) -> None:
        """Hold blocks of requests in a batch (a reader may come before the lease is set),
        release aborted ones, and set the lease vLLM's scheduler stamped."""
        svc = self._svc()
        if svc.tracker is None:
            return
        new = [r for r in metadata.reqs_in_batch if r not in self._held]
        if new:
            svc.hold(new, lease_s=float("inf"))
            self._held.update(new)
        gone = [r for r in metadata.reqs_not_processed if r in self._held]
        if gone:
            svc.unhold(gone)
            self._held.difference_update(gone)
        clock = metadata.scheduler_clock
        for req_id, expires in metadata.reqs_to_send.items():
            if req_id in self._held:
                ttl = expires - clock if clock else self.lease_s
                svc.set_lease(req_id, max(ttl, 0.0))

    # -- results --------------------------------------------------------------------------------
    def get_transfer_results(self) -> KVConnectorTransferResults:
        svc = self._svc()
        self._drain_handshakes()
        svc.progress()    # once per engine step: vLLM's model runner drives the agent
        done = svc.completions(poll=False)
        sending = set(done["finished"]) | set(done["expired"])
        self._held.difference_update(sending)
        recving: set[str] = set()
        for res in svc.take_pull_results():
            if res.ok:
                if self._recving.pop(res.request_id, None) is not None:
                    recving.add(res.request_id)
                continue
            self._failed.add(res.request_id)
            if res.cause not in _REQUEST_FAULTS:
                meta = self._recving.get(res.request_id)
                if meta is not None and meta.remote is not None:
                    svc.drop_remote(meta.remote.engine_id, f"transfer failed: {res.cause}")
        failed: set[str] = set()
        for req_id in self._failed:
            meta = self._recving.pop(req_id, None)
            if meta is None:
                continue       # a notify-only request: its KV is local
            failed.add(req_id)
            if not self.facts.hma and meta.local_block_ids:
                self._load_errors.update(meta.local_block_ids[0])
        self._failed.clear()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving | failed, failed_recving=failed)

    def get_finished(self) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results()
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> None:
        return None   # kvbridge exports Prometheus metrics of its own

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """Host staging buffers are refused at start-up; nothing to copy."""

    def shutdown(self) -> None:
        self._stop.set()
        if self.duties is not None:
            self.duties.stop()
            self.duties = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.service is not None:
            self.service.close()
            self.service = None

    def _svc(self) -> AgentService:
        if self.service is None:
            raise RuntimeError("KVBridgeConnector worker: register_kv_caches has not run")
        return self.service
