"""Names the operator shares with the CRDs, and its runtime settings (``KVBRIDGE_*``)."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

from kvbridge_agent import resources as _shared

from .lease import Timing

# The names the agent, the operator and the CRDs share: defined once, in kvbridge_agent.
GROUP, VERSION = _shared.GROUP, _shared.VERSION
TRANSFERS, ENDPOINTS = _shared.TRANSFERS, _shared.ENDPOINTS
PREFILL, DECODE, ROLES = _shared.PREFILL, _shared.DECODE, _shared.ROLES

#: kopf finalizer on KVTransfers (clears the endpoints' peers before the transfer goes).
FINALIZER = f"{GROUP}/finalizer"
#: Prefix of kopf's progress/diff-base annotations (``kvbridge.io/...``).
ANNOTATION_PREFIX = GROUP

#: KVEndpoint ``status.peers`` maxItems in the CRD (docs/limits.md, "Object sizes").
MAX_PEERS = 128
#: Revision series per KVTransfer in the metrics (a label per model revision: bounded, like
#: status.revisions, so a runaway of fingerprints cannot grow the series without end).
MAX_REVISION_SERIES = 32


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from exc


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{name}: expected a number, got {raw!r}") from exc


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: expected true or false, got {raw!r}")


def default_identity() -> str:
    """This replica's name in the Lease: its pod's name (``POD_NAME``, from the downward API),
    so that a container restarted in the same pod is the same holder and leads again at once;
    outside a pod, host, process and a random suffix (never the name of another process)."""
    return os.environ.get("POD_NAME") or (
        f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    )


@dataclass(frozen=True)
class Settings:
    """Operator settings, read once at startup from the environment."""

    #: Prometheus metrics port (KVBRIDGE_METRICS_PORT, 0 disables).
    metrics_port: int = 8080
    #: Address the metrics server binds (KVBRIDGE_METRICS_ADDR).
    metrics_addr: str = "0.0.0.0"
    #: Admission webhook HTTPS port (KVBRIDGE_WEBHOOK_PORT, 0 disables the webhook server).
    webhook_port: int = 0
    #: Address the webhook server binds (KVBRIDGE_WEBHOOK_ADDR).
    webhook_addr: str = "0.0.0.0"
    #: PEM certificate and key for the webhook (KVBRIDGE_WEBHOOK_CERT / KVBRIDGE_WEBHOOK_KEY);
    #: when unset a self-signed pair for KVBRIDGE_WEBHOOK_HOST is generated with openssl.
    webhook_cert: str = ""
    webhook_key: str = ""
    webhook_host: str = "localhost"
    #: Act only while holding the Lease (KVBRIDGE_LEADER_ELECTION); false: always act (one
    #: replica only). See :mod:`.leader` and docs/operations.md.
    leader_election: bool = True
    #: The coordination.k8s.io Lease (KVBRIDGE_LEASE_NAME) in KVBRIDGE_LEASE_NAMESPACE, else the
    #: pod's namespace (POD_NAMESPACE), else ``default``.
    lease_name: str = "kvbridge-operator"
    lease_namespace: str = "default"
    #: This replica's holderIdentity (KVBRIDGE_LEADER_IDENTITY; default :func:`default_identity`).
    identity: str = ""
    #: Seconds a standby waits, after it last saw the Lease change, before taking it over
    #: (KVBRIDGE_LEASE_DURATION; whole seconds, the Lease's leaseDurationSeconds).
    lease_duration: int = 15
    #: Seconds after the start of its last successful renewal at which a leader stops acting
    #: (KVBRIDGE_LEASE_RENEW_DEADLINE); less than the lease duration.
    renew_deadline: float = 10.0
    #: Seconds between two tries to acquire or renew (KVBRIDGE_LEASE_RETRY_PERIOD).
    retry_period: float = 2.0
    #: Seconds to wait after a change before re-planning, so bursts coalesce (KVBRIDGE_DEBOUNCE).
    debounce: float = 0.2
    #: Seconds between unconditional re-plans of a KVTransfer (KVBRIDGE_RESYNC).
    resync: float = 300.0
    #: Concurrent status patches per KVTransfer (KVBRIDGE_WRITE_CONCURRENCY).
    write_concurrency: int = 8
    #: Level of kopf's per-object log ("Handler ... succeeded") (KVBRIDGE_KOPF_LOG_LEVEL).
    kopf_log_level: str = "WARNING"
    #: Users allowed to write any pod's KVEndpoint besides cluster admins and the controllers
    #: (KVBRIDGE_ADMISSION_EXEMPT_USERS, comma-separated); see :mod:`.pod_identity`.
    admission_exempt_users: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.leader_election:
            self.timing  # noqa: B018 -- refuses inconsistent lease settings at start-up

    @property
    def timing(self) -> Timing:
        """The leader election's timing (checked: see :class:`.lease.Timing`)."""
        return Timing(self.lease_duration, self.renew_deadline, self.retry_period)

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            metrics_port=_env_int("KVBRIDGE_METRICS_PORT", cls.metrics_port),
            metrics_addr=os.environ.get("KVBRIDGE_METRICS_ADDR", cls.metrics_addr),
            webhook_port=_env_int("KVBRIDGE_WEBHOOK_PORT", cls.webhook_port),
            webhook_addr=os.environ.get("KVBRIDGE_WEBHOOK_ADDR", cls.webhook_addr),
            webhook_cert=os.environ.get("KVBRIDGE_WEBHOOK_CERT", ""),
            webhook_key=os.environ.get("KVBRIDGE_WEBHOOK_KEY", ""),
            webhook_host=os.environ.get("KVBRIDGE_WEBHOOK_HOST", cls.webhook_host),
            leader_election=_env_bool("KVBRIDGE_LEADER_ELECTION", cls.leader_election),
            lease_name=os.environ.get("KVBRIDGE_LEASE_NAME") or cls.lease_name,
            lease_namespace=os.environ.get("KVBRIDGE_LEASE_NAMESPACE")
            or os.environ.get("POD_NAMESPACE")
            or cls.lease_namespace,
            identity=os.environ.get("KVBRIDGE_LEADER_IDENTITY") or default_identity(),
            lease_duration=_env_int("KVBRIDGE_LEASE_DURATION", cls.lease_duration),
            renew_deadline=_env_float("KVBRIDGE_LEASE_RENEW_DEADLINE", cls.renew_deadline),
            retry_period=_env_float("KVBRIDGE_LEASE_RETRY_PERIOD", cls.retry_period),
            debounce=_env_float("KVBRIDGE_DEBOUNCE", cls.debounce),
            resync=_env_float("KVBRIDGE_RESYNC", cls.resync),
            write_concurrency=_env_int("KVBRIDGE_WRITE_CONCURRENCY", cls.write_concurrency),
            kopf_log_level=os.environ.get("KVBRIDGE_KOPF_LOG_LEVEL", cls.kopf_log_level).upper(),
            admission_exempt_users=tuple(
                u.strip()
                for u in os.environ.get("KVBRIDGE_ADMISSION_EXEMPT_USERS", "").split(",")
                if u.strip()
            ),
        )
