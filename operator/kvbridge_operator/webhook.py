"""The admission webhook's serving side: kopf server settings, certificates, and the
ValidatingWebhookConfiguration that points the apiserver at it (for tests, the chart, demos).

kopf's own self-signed certificate path fails with OpenSSL 3, so a missing certificate is
generated here with the ``openssl`` command line.

kopf's server (aiohttp) reads at most 1 MiB per request, but an UPDATE's AdmissionReview
carries the object and its old version: a KVEndpoint of 0.6 MB could be created and then
never updated. :class:`WebhookServer` reads up to :data:`MAX_REVIEW_BYTES`.
"""

from __future__ import annotations

import base64
import ipaddress
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import kopf

from .config import ENDPOINTS, GROUP, TRANSFERS, VERSION, Settings

#: Largest AdmissionReview read: an UPDATE carries two objects, each up to the apiserver's
#: 3 MiB request limit (etcd stores at most 1.5 MiB), plus the review's own fields.
MAX_REVIEW_BYTES = 8 * 1024 * 1024

#: kopf handler id -> plural; kopf serves each handler at ``/<id>``.
WEBHOOKS = {"validate-kvendpoint": ENDPOINTS, "validate-kvtransfer": TRANSFERS}


def self_signed_certificate(
    directory: Path, hosts: list[str], name: str = "webhook"
) -> tuple[Path, Path]:
    """A self-signed serving certificate (also its own CA) for ``hosts``; (cert, key) as
    ``<name>.crt`` / ``<name>.key``. openssl, since kopf's own path fails with OpenSSL 3."""
    directory.mkdir(parents=True, exist_ok=True)
    crt, key = directory / f"{name}.crt", directory / f"{name}.key"
    sans = []
    for h in hosts:
        try:
            ipaddress.ip_address(h)
            sans.append(f"IP:{h}")
        except ValueError:
            sans.append(f"DNS:{h}")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-sha256",
            "-days",
            "365",
            "-keyout",
            str(key),
            "-out",
            str(crt),
            "-subj",
            f"/CN={hosts[0]}",
            "-addext",
            f"subjectAltName={','.join(sans)}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
        ],
        check=True,
        capture_output=True,
    )
    return crt, key


class WebhookServer(kopf.WebhookServer):
    """kopf's server, reading request bodies up to :data:`MAX_REVIEW_BYTES` (aiohttp's
    default, 1 MiB, refuses the UPDATE of any object over about 0.5 MB)."""

    @staticmethod
    async def _serve(fn: Any, request: Any) -> Any:
        big = request.clone(client_max_size=MAX_REVIEW_BYTES)
        return await kopf.WebhookServer._serve(fn, big)


def server(settings: Settings) -> Any:
    """The kopf webhook server for ``settings`` (generates a certificate when none given)."""
    cert, key = settings.webhook_cert, settings.webhook_key
    if not cert or not key:
        hosts = sorted({settings.webhook_host, "localhost", "127.0.0.1"})
        crt_path, key_path = self_signed_certificate(
            Path(tempfile.mkdtemp(prefix="kvb-webhook-")), [settings.webhook_host, *hosts]
        )
        cert, key = str(crt_path), str(key_path)
    return WebhookServer(
        addr=settings.webhook_addr,
        port=settings.webhook_port,
        host=settings.webhook_host,
        certfile=cert,
        pkeyfile=key,
        cafile=cert,
    )


def webhook_configuration(
    name: str,
    ca_bundle: bytes,
    *,
    url: str | None = None,
    service: dict[str, Any] | None = None,
    timeout_seconds: int = 10,
) -> dict[str, Any]:
    """ValidatingWebhookConfiguration for both resources (``url`` or ``service`` base).

    Only the main resources are matched, not ``/status``: the agent's and operator's status
    writes never wait for the webhook.
    """
    webhooks = []
    for hook_id, plural in WEBHOOKS.items():
        client: dict[str, Any] = {"caBundle": base64.b64encode(ca_bundle).decode()}
        if url is not None:
            client["url"] = f"{url.rstrip('/')}/{hook_id}"
        else:
            svc = dict(service or {})
            svc["path"] = f"{svc.get('path', '').rstrip('/')}/{hook_id}"
            client["service"] = svc
        webhooks.append(
            {
                "name": f"{plural}.{GROUP}",
                "rules": [
                    {
                        "apiGroups": [GROUP],
                        "apiVersions": [VERSION],
                        "resources": [plural],
                        "operations": ["CREATE", "UPDATE"],
                        "scope": "Namespaced",
                    }
                ],
                "clientConfig": client,
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "matchPolicy": "Equivalent",
                "admissionReviewVersions": ["v1", "v1beta1"],
                "timeoutSeconds": timeout_seconds,
            }
        )
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": webhooks,
    }
