"""kopf registration: run with ``kopf run --all-namespaces -m kvbridge_operator.main``.

Handlers only translate kopf kwargs and call into ``reconciler`` / ``admission``:

- ``endpoints_by_transfer`` / ``transfers`` / ``node_labels``: in-memory indexes fed by
  kopf's watches;
- ``endpoint_event`` / ``transfer_event``: wake the KVTransfer's planning loop, and mark
  endpoints whose KVTransfer does not exist (or was just deleted) ``Orphaned``;
- ``plan_transfer``: the per-KVTransfer daemon (plan, write, wait);
- ``release_endpoints``: on KVTransfer deletion (finalizer ``kvbridge.io/finalizer``);
- ``validate_kvendpoint`` / ``validate_kvtransfer``: admission webhooks;
- ``configure``: settings (finalizer, kopf's bookkeeping, webhook server, metrics) and the
  leader election (``leader``: only the Lease holder watches, plans and writes; every
  replica serves the webhooks).

Importing this module also makes kopf's watch streams survive a kube-apiserver restart
(see ``kopf_watch``) and lets the Lease pause kopf (see ``leader``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import kopf

from kvbridge_agent.resources import ENDPOINT_FIELDS

from . import (
    admission,
    kopf_watch,
    leader,
    metrics,
    persistence,
    pod_identity,
    reconciler,
    runtime,
    webhook,
)
from .config import ENDPOINTS, FINALIZER, GROUP, TRANSFERS, VERSION
from .errors import SpecError
from .kube import Kube, NotLeading, load_api_client
from .spec import Endpoint, parse_endpoint

log = logging.getLogger("kvbridge.operator")
kopf_watch.install()
leader.install()

#: Seconds before kopf runs a deferred release again (the API server did not answer).
RELEASE_AGAIN_S = 5.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's settings from KVBRIDGE_* variables (see :class:`config.Settings`), and the
    :class:`runtime.Runtime` every handler finds in its memo."""
    cfg = runtime.settings()
    settings.persistence.finalizer = FINALIZER
    persistence.configure(settings)
    settings.posting.loggers = False  # Events only on condition transitions (reconciler).
    # kopf logs every successful handler call at INFO; with a watch event per endpoint
    # change that drowns the operator's own messages. Failures still log at WARNING+.
    logging.getLogger("kopf.objects").setLevel(cfg.kopf_log_level)
    logging.getLogger("kopf.objects").addFilter(_drop_refusal_errors)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # No kopf peering: the Lease decides which replica acts (see leader).
    settings.peering.standalone = True
    if cfg.webhook_port:
        settings.admission.server = webhook.server(cfg)
    api_client = load_api_client()
    elector = None
    if cfg.leader_election:
        elector = leader.LeaderElector(api_client, namespace=cfg.lease_namespace,
                                       name=cfg.lease_name, identity=cfg.identity,
                                       timing=cfg.timing)
    else:
        metrics.LEADER.set(1)
    leader.use(elector)
    kube = Kube(api_client, cfg.write_concurrency,
                may_write=elector.leading if elector is not None else None)
    rt = memo.runtime = runtime.Runtime(cfg, kube, leader=elector)
    metrics.track(rt.tracked)
    metrics.serve(cfg.metrics_port, cfg.metrics_addr)


@kopf.on.cleanup()
async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    rt = getattr(memo, "runtime", None)
    if rt is not None:
        if rt.leader is not None:
            await rt.leader.release()  # done already when kopf's orchestrator stopped
            rt.leader.close()
        rt.kube.close()


@kopf.index(GROUP, VERSION, ENDPOINTS)
def endpoints_by_transfer(body: kopf.Body, namespace: str, name: str, **_: Any) -> Any:
    """(namespace, transferName) -> parsed KVEndpoints; unparsable ones are logged, left out."""
    try:
        endpoint = parse_endpoint(body)
    except SpecError as exc:
        log.warning("KVEndpoint %s/%s ignored: %s", namespace, name, exc)
        return None
    return {(namespace, endpoint.transfer): endpoint}


@kopf.index(GROUP, VERSION, TRANSFERS)
def transfers(namespace: str, name: str, **_: Any) -> Any:
    """(namespace, name) of every KVTransfer, to tell orphaned KVEndpoints apart."""
    return {(namespace, name): True}


@kopf.index("v1", "nodes")
def node_labels(name: str, labels: kopf.Labels, **_: Any) -> Any:
    """node name -> labels, for the TopologyAware pairing policy."""
    return {name: dict(labels)}


@kopf.index("v1", "nodes")
def lost_nodes(name: str, status: kopf.Status, **_: Any) -> Any:
    """Names of nodes whose Ready condition is False or Unknown: their endpoints get no peers.
    (An empty mapping, not None, so a node that is Ready again leaves the index: kopf keeps an
    object's old entries when its index function returns None.)"""
    return {name: True} if node_lost(status) else {}


def node_lost(status: Any) -> bool:
    """True when the node reports a Ready condition that is not True (the kubelet stopped
    posting status, or says it is not ready); a node without one yet is not judged."""
    ready = [c for c in (status or {}).get("conditions") or () if c.get("type") == "Ready"]
    return bool(ready) and ready[0].get("status") != "True"


@kopf.on.event("v1", "nodes")
def node_event(
    name: str, labels: kopf.Labels, status: kopf.Status, type: str | None, memo: kopf.Memo,
    **_: Any,
) -> None:
    """Re-plan everything when a node's labels (TopologyAware reads them) or readiness change."""
    rt = runtime.from_memo(memo)
    deleted = type == "DELETED"
    if rt.node_changed(name, None if deleted else dict(labels), not deleted and node_lost(status)):
        rt.loops.wake_all()


@kopf.on.event(GROUP, VERSION, ENDPOINTS)
async def endpoint_event(
    namespace: str,
    spec: kopf.Spec,
    body: kopf.Body,
    type: str | None,
    transfers: kopf.Index,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Wake the endpoint's KVTransfer loop; with no such KVTransfer, say so on the endpoint.
    A listed endpoint (type None: startup, or a relist after 410 Gone) makes every loop look
    for endpoints deleted while the watch was down (see reconciler)."""
    rt = runtime.from_memo(memo)
    transfer = ENDPOINT_FIELDS.transfer.get(spec)
    if type is None:
        rt.loops.relisted()
    rt.loops.wake(namespace, transfer)
    if type == "DELETED" or (namespace, transfer) in transfers:
        return
    try:
        endpoint = parse_endpoint(body)
    except SpecError:
        return  # logged by the index
    with contextlib.suppress(NotLeading):  # the Lease was lost: the next leader writes it
        await reconciler.orphan(endpoint, rt.kube)


@kopf.on.event(GROUP, VERSION, TRANSFERS)
async def transfer_event(
    namespace: str,
    name: str,
    type: str | None,
    endpoints_by_transfer: kopf.Index,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Wake the KVTransfer's loop; once it is gone, its endpoints say it was deleted."""
    rt = runtime.from_memo(memo)
    rt.loops.wake(namespace, name)
    if type == "DELETED":
        with contextlib.suppress(NotLeading):
            for e in _endpoints(endpoints_by_transfer, namespace, name):
                await reconciler.orphan(e, rt.kube, deleted=True)


@kopf.daemon(
    GROUP, VERSION, TRANSFERS, id="plan", cancellation_backoff=0.5, cancellation_timeout=5.0
)
async def plan_transfer(
    name: str,
    namespace: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    endpoints_by_transfer: kopf.Index,
    node_labels: kopf.Index,
    lost_nodes: kopf.Index,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Plan this KVTransfer whenever its endpoints or spec change (see reconciler)."""
    rt = runtime.from_memo(memo)
    ctx = reconciler.Context(
        namespace, name, rt.kube, rt.settings,
        emit=lambda type_, reason, msg: kopf.event(body, type=type_, reason=reason, message=msg),
    )  # fmt: skip
    await reconciler.run(
        ctx,
        rt.loops,
        body=body,
        endpoints=lambda: _endpoints(endpoints_by_transfer, namespace, name),
        nodes=lambda: {k: next(iter(v), {}) for k, v in node_labels.items()},
        lost=lambda: frozenset(lost_nodes),
        stopped=stopped,
    )


@kopf.on.delete(GROUP, VERSION, TRANSFERS, id="release")
async def release_endpoints(
    name: str, namespace: str, endpoints_by_transfer: kopf.Index, memo: kopf.Memo, **_: Any
) -> None:
    """Withdraw peers from the endpoints of a deleted KVTransfer (bounded: see
    :func:`reconciler.release`). A refused write releases the finalizer anyway; an API server
    that does not answer keeps it, and kopf runs this again."""
    try:
        await reconciler.release(
            namespace, name, _endpoints(endpoints_by_transfer, namespace, name),
            runtime.from_memo(memo).kube,
        )  # fmt: skip
    except (reconciler.ReleaseDeferred, NotLeading) as exc:
        raise kopf.TemporaryError(str(exc), delay=RELEASE_AGAIN_S) from exc


def validate_kvendpoint(body: kopf.Body, old: Any, userinfo: Any, **_: Any) -> None:
    """Schema-independent rules, and only the owning pod may write a KVEndpoint's spec."""
    settings = runtime.settings()
    identity = pod_identity.check_pod_identity(
        body, userinfo, exempt_users=settings.admission_exempt_users
    )
    _admit(
        ENDPOINTS,
        body,
        admission.check_endpoint(body, old) + identity,
        reason="pod_identity" if identity else "invalid_spec",
    )


def validate_kvtransfer(body: kopf.Body, old: Any, **_: Any) -> None:
    _admit(TRANSFERS, body, admission.check_transfer(body, old), reason="invalid_spec")


# kopf refuses to start with admission handlers but no server, so the webhooks exist only
# when KVBRIDGE_WEBHOOK_PORT is set (a webhook-less install runs without). Every replica,
# standby or leader, serves them.
if runtime.settings().webhook_port:
    kopf.on.validate(GROUP, VERSION, ENDPOINTS, id="validate-kvendpoint")(validate_kvendpoint)
    kopf.on.validate(GROUP, VERSION, TRANSFERS, id="validate-kvtransfer")(validate_kvtransfer)


_WEBHOOK_IDS = ("validate-kvendpoint", "validate-kvtransfer")


def _drop_refusal_errors(record: logging.LogRecord) -> bool:
    """kopf logs every refusal of ours as an ERROR ("Webhook ... failed permanently"); it is
    an expected answer, already logged by :func:`_admit` at WARNING, so drop kopf's line."""
    message = record.getMessage()
    return not any(f"Webhook {i!r} failed permanently: " in message for i in _WEBHOOK_IDS)


def _admit(resource: str, body: kopf.Body, problems: list[str], *, reason: str) -> None:
    """Refuse with the problems, counted and logged once here: a refusal is an expected
    answer, so no traceback, but a platform team wants to see and alert on them."""
    if not problems:
        return
    message = "; ".join(problems)
    metrics.ADMISSION_REFUSALS.labels(resource, reason).inc()
    meta = body.get("metadata") or {}
    log.warning(
        "admission refused %s %s/%s (%s): %s",
        resource,
        meta.get("namespace") or "",
        meta.get("name") or meta.get("generateName") or "",
        reason,
        message,
    )
    raise kopf.AdmissionError(message, code=422)


def _endpoints(index: kopf.Index, namespace: str, name: str) -> list[Endpoint]:
    return [e for e in index.get((namespace, name), ()) if isinstance(e, Endpoint)]
