"""The admission webhook: registering the local operator's, waiting until the apiserver calls
it, and showing it refuse a malformed and a hijacking KVEndpoint."""

from __future__ import annotations

import json
import re

from kvbridge_testkit import cluster as kc

from .common import NS, say


def register_webhook(cluster: kc.LocalCluster, port: int, ca: bytes, cleanup: list) -> None:
    """Register the ValidatingWebhookConfiguration of the (started, listening) operator's
    webhook (URL form, the caller's CA) and wait until the apiserver calls it."""
    from kubernetes import client

    from kvbridge_operator.webhook import webhook_configuration

    reg = client.AdmissionregistrationV1Api(cluster.api_client())
    reg.create_validating_webhook_configuration(webhook_configuration(
        "kvbridge-validation", ca, url=f"https://127.0.0.1:{port}"))

    def unregister() -> None:   # before the operator stops: no write waits on a dead webhook
        reg.delete_validating_webhook_configuration("kvbridge-validation")

    cleanup.append(unregister)
    wait_webhook_answering(cluster)


def wait_webhook_answering(cluster: kc.LocalCluster) -> None:
    """Until the apiserver calls the webhook: a dry run only the webhook refuses."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from kvbridge_testkit.sim import wait_until

    custom = client.CustomObjectsApi(cluster.api_client())
    probe = {"apiVersion": "kvbridge.io/v1alpha1", "kind": "KVTransfer",
             "metadata": {"name": "webhook-probe"},
             "spec": {"protocolVersion": 10, "mode": "pull",
                      "prefill": {"tensorParallelSize": 1},
                      "decode": {"tensorParallelSize": 1}}}

    def answering() -> bool:
        try:
            custom.create_namespaced_custom_object("kvbridge.io", "v1alpha1", NS,
                                                   "kvtransfers", probe, dry_run="All")
        except ApiException as exc:
            return exc.status == 422 and "spec.protocolVersion" in exc.body
        return False

    wait_until(answering, timeout=60, interval=0.5, what="the apiserver to call the webhook")


def show_admission(cluster: kc.LocalCluster, custom: object, sa: str) -> None:
    """As decode-0 (its pod-bound token): a malformed KVEndpoint, then an attempt to redirect
    prefill-0's side channel; the webhook refuses both with a message."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from kvbridge_testkit.sim import pod_bound_token

    token = pod_bound_token(cluster.kubectl, NS, sa, "decode-0", seconds=600)
    as_decode = client.CustomObjectsApi(
        cluster.api_client(cluster.kubeconfig_for_token(token, "demo-decode-0")))
    own = custom.get_namespaced_custom_object(  # type: ignore[attr-defined]
        "kvbridge.io", "v1alpha1", NS, "kvendpoints", "decode-0")
    bad = {"apiVersion": "kvbridge.io/v1alpha1", "kind": "KVEndpoint",
           "metadata": {"name": "decode-0-rank2",
                        "ownerReferences": own["metadata"]["ownerReferences"]},
           "spec": {**own["spec"], "tpRank": 2, "tpSize": 1}}
    attempts = [
        ("decode-0 publishes a KVEndpoint with tpRank 2 of tpSize 1",
         lambda: as_decode.create_namespaced_custom_object(
             "kvbridge.io", "v1alpha1", NS, "kvendpoints", bad)),
        ("decode-0 rewrites prefill-0's side-channel address to 10.9.9.9",
         lambda: as_decode.patch_namespaced_custom_object(
             "kvbridge.io", "v1alpha1", NS, "kvendpoints", "prefill-0",
             {"spec": {"sideChannel": {"host": "10.9.9.9", "port": 5600}}})),
    ]
    for what, call in attempts:
        try:
            call()
        except ApiException as exc:
            message = str(json.loads(exc.body).get("message", exc.reason))
            head, sep, problems = message.partition("denied the request: ")
            by = head.strip() if sep else "the apiserver"
            say(f"admission: {what}: refused (HTTP {exc.status}) by {by}:")
            # The webhook joins its problems with "; ", each starting with a field path.
            for problem in re.split(r"; (?=(?:metadata|spec)\.)", problems or message):
                print(f"           - {problem[:220]}", flush=True)
        else:
            raise SystemExit(f"admission: {what}: was ADMITTED; the webhook is not working")
