"""`epd-dataplane`: the data plane's processes, which run in the pods the operator makes: the
EPD proxy in each unit (`proxy`) and each proxied model's EPD gateway (`gateway`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from epd_operator.api import EPP_HEALTH_PORT, EPP_PORT, PROXY_METRICS_PORT
from epd_operator.argtypes import byte_quantity, int_at_least, port, positive, positive_int
from epd_operator.proxy_limits import Limits

from .media_urls import MediaURLPolicy


def _proxy(args: argparse.Namespace) -> None:
    from .encoders import Ejection
    from .process import run_proxy

    run_proxy(
        host=args.host,
        port=args.port,
        upstream=args.upstream,
        encoder_urls=args.encoder,
        encoders_dns=args.encoders_dns,
        dns_refresh_seconds=args.encoders_dns_refresh_seconds,
        metrics_port=args.metrics_port,
        request_timeout_seconds=args.request_timeout_seconds,
        prime_timeout_seconds=args.prime_timeout_seconds,
        prime_attempt_timeout_seconds=args.prime_attempt_timeout_seconds,
        prime_max_attempts=args.prime_max_attempts,
        prime_concurrency=args.prime_concurrency,
        ejection=Ejection.given(args.eject_after_failures, args.ejection_base_seconds, args.ejection_max_seconds),
        limits=proxy_limits(args),
        pooled=args.placement == "Pools",
        ec_store=args.ec_store,
        require_weights_version=args.require_weights_version,
        shutdown_timeout_seconds=args.shutdown_timeout_seconds,
        log_level=args.log_level,
        media=media_policy(args),
    )


def _gateway(args: argparse.Namespace) -> None:
    from .epp import EPPConfig
    from .gateway import parse_units
    from .process import run_gateway

    try:
        units = parse_units(args.unit)
    except ValueError as error:
        raise SystemExit(f"epd-dataplane gateway: {error}") from None
    if not units and not (args.namespace and args.deployment and args.units_service):
        raise SystemExit(
            "epd-dataplane gateway: give --namespace, --deployment and --units-service (the gateway watches them), "
            "or --unit NAME=URL for fixed units"
        )
    run_gateway(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        model=args.model,
        units=units,
        weights_version=args.weights_version,
        namespace=args.namespace,
        deployment=args.deployment,
        units_service=args.units_service,
        balance=args.max_load_percent / 100,
        request_timeout_seconds=args.request_timeout_seconds,
        limits=proxy_limits(args),
        shutdown_timeout_seconds=args.shutdown_timeout_seconds,
        log_level=args.log_level,
        media=media_policy(args),
        epp=None
        if args.epp_port is None
        else EPPConfig(
            args.epp_port,
            args.epp_health_port,
            args.epp_secure_serving,
            args.epp_cert_path,
            args.host,
            args.epp_fallbacks,
        ),
        epp_names=args.epp_name or ["localhost"],
    )


def proxy_limits(args: argparse.Namespace) -> Limits:
    """The proxy's Limits from its flags; exits with the rule broken when they do not fit."""

    try:
        return Limits(**{name: getattr(args, name) for name in Limits.__dataclass_fields__})
    except ValueError as error:
        raise SystemExit(f"epd-dataplane proxy: {error}") from None


def _dns_target(text: str) -> str:
    from .core import DNSTarget

    try:
        DNSTarget.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _add_proxy_parser(sub: Any) -> None:
    proxy = sub.add_parser(
        "proxy",
        help="the EPD proxy: primes the media of OpenAI requests on the encoders, then forwards them",
        description="Serve in front of a unit's router (or its only consumer): every media part of a "
        "POST /v1/chat/completions or /v1/responses is primed on the encoders first (one image-only request "
        "each, round-robin, with epd_client's retry policy), then the request goes to the upstream unchanged "
        "and its answer streams back. Every other request passes straight through. docs/proxy.md.",
    )
    proxy.add_argument("--host", default="0.0.0.0", help="address to listen on")
    proxy.add_argument("--port", type=port, default=8000, help="port to listen on: the one the front Service targets")
    proxy.add_argument(
        "--upstream",
        required=True,
        help="base URL of the router or the unit's only consumer, e.g. http://127.0.0.1:8001",
    )
    encoders = proxy.add_mutually_exclusive_group(required=True)
    encoders.add_argument(
        "--encoder",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of an encoder to prime on (repeatable): a unit's encoders, on the pod's loopback",
    )
    encoders.add_argument(
        "--encoders-dns",
        type=_dns_target,
        metavar="HOST:PORT[,PORT...]",
        help="prime on every address of HOST, at each PORT: a Pools model's encoder pool through its "
        "headless Service, e.g. demo-default-encoders.team-a.svc:8100 (needs cluster DNS)",
    )
    proxy.add_argument(
        "--encoders-dns-refresh-seconds",
        type=positive,
        default=5.0,
        help="seconds between two resolutions of --encoders-dns (CoreDNS answers for a headless Service "
        "with a 5 s TTL)",
    )
    proxy.add_argument(
        "--placement",
        choices=["Unit", "Pools"],
        default="Unit",
        help="the model's placement: with Pools every prime must announce ec_transfer_params, which the "
        "forwarded request carries so the consumer pulls each embedding from its encoder",
    )
    proxy.add_argument(
        "--ec-store",
        metavar="PATH",
        help="placement Unit with ECExampleConnector: the unit's EC store (its shared_storage_path, mounted here). "
        "A media part the store holds already is not primed again, and what requests rely on is leased against "
        "the janitor's evictions",
    )
    proxy.add_argument(
        "--require-weights-version",
        action="store_true",
        help="refuse media requests without an X-EPD-Weights-Version header (the model's weights are versioned: "
        "its EPD gateway stamps the version on what it forwards)",
    )
    proxy.add_argument(
        "--metrics-port", type=port, default=PROXY_METRICS_PORT, help="port of the proxy's own /metrics and /health"
    )
    proxy.add_argument(
        "--request-timeout-seconds",
        type=positive,
        default=1800.0,
        help="limit of one forwarded request, streaming included (vllm-router's default)",
    )
    proxy.add_argument(
        "--prime-timeout-seconds",
        type=positive,
        default=600.0,
        help="limit of priming one media part, retries included (epd_client's deadline)",
    )
    proxy.add_argument(
        "--prime-attempt-timeout-seconds",
        type=positive,
        default=None,
        help="limit of one prime request to one encoder, then retried on the next encoder (default: epd_client's, "
        "300; at most --prime-timeout-seconds counts)",
    )
    proxy.add_argument(
        "--prime-max-attempts", type=positive_int, default=20, help="attempts per media part (epd_client's)"
    )
    proxy.add_argument(
        "--eject-after-failures",
        type=int_at_least(0),
        help="leave an encoder out of priming after this many failed prime requests in a row (no answer in time, "
        "no connection, a 5xx); 0: never (default: 5, Envoy's consecutive gateway failures)",
    )
    proxy.add_argument(
        "--ejection-base-seconds",
        type=positive,
        help="how long an encoder is left out, times the number of times in a row it was (default: 30)",
    )
    proxy.add_argument(
        "--ejection-max-seconds", type=positive, help="the longest an encoder is left out (default: 300)"
    )
    proxy.add_argument(
        "--prime-concurrency", type=positive_int, default=64, help="prime requests in flight at once, at most"
    )
    _add_limits(proxy)
    proxy.add_argument(
        "--shutdown-timeout-seconds",
        type=positive,
        default=25.0,
        help="on SIGTERM, how long requests in flight may take to finish (keep it under the pod's "
        "terminationGracePeriodSeconds)",
    )
    _add_media(proxy)
    proxy.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="a prime failure is a WARNING line",
    )
    proxy.set_defaults(func=_proxy)


def _add_gateway_parser(sub: Any) -> None:
    gateway = sub.add_parser(
        "gateway",
        help="the EPD gateway: sends each request to the unit that holds its media, with the weights version",
        description="Serve in front of a model's units (its front Service targets the gateway): each request goes "
        "to a ready unit's EPD proxy, the one its conversation or its first picture prefers (rendezvous hashing "
        "with bounded load, epd_client's), so repeats find their embeddings stored; the model's "
        "spec.models[].weightsVersion goes with it as X-EPD-Weights-Version unless the client sent one. The "
        "units and the version come from watching the EPDDeployment and its units' EndpointSlices. "
        "Example: epd-dataplane gateway --namespace team-a --deployment demo --model actor "
        "--units-service demo-actor-units. docs/proxy.md.",
    )
    gateway.add_argument("--host", default="0.0.0.0", help="address to listen on")
    gateway.add_argument("--port", type=port, default=8000, help="port to listen on: the one the front Service targets")
    gateway.add_argument(
        "--metrics-port", type=port, default=PROXY_METRICS_PORT, help="port of the gateway's /metrics, /health, /ready"
    )
    gateway.add_argument("--model", required=True, help="the model of the EPDDeployment whose units it fronts")
    gateway.add_argument("--namespace", help="the EPDDeployment's namespace")
    gateway.add_argument("--deployment", help="the EPDDeployment's name")
    gateway.add_argument(
        "--units-service", help="the units' headless Service, whose EndpointSlices say where each unit is"
    )
    gateway.add_argument(
        "--unit",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="instead of watching: a unit's name and its EPD proxy's URL (repeatable; tests and benchmarks)",
    )
    gateway.add_argument("--weights-version", help="with --unit: the version to send with requests that carry none")
    gateway.add_argument(
        "--max-load-percent",
        type=int_at_least(100),
        default=125,
        help="the most requests in flight a unit takes, in percent of the mean over the ready units, before a "
        "request goes to its key's next unit (bounded-load hashing)",
    )
    gateway.add_argument(
        "--request-timeout-seconds",
        type=positive,
        default=1800.0,
        help="limit of one forwarded request, streaming included (vllm-router's default)",
    )
    _add_limits(gateway)
    _add_media(gateway)
    epp = gateway.add_argument_group(
        "endpoint picker",
        "Also serve the Gateway API Inference Extension's endpoint picker protocol (Envoy's ext_proc over gRPC), "
        "so a Gateway routing an InferencePool places requests as the gateway does (docs/gateway-api.md)",
    )
    epp.add_argument(
        "--epp-port", type=port, help=f"serve the endpoint picker on this port (GAIE's {EPP_PORT}); default: not served"
    )
    epp.add_argument(
        "--epp-health-port",
        type=port,
        default=EPP_HEALTH_PORT,
        help="the picker's gRPC health services (liveness, readiness, inference-extension) on this port",
    )
    epp.add_argument(
        "--epp-secure-serving",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TLS on the picker's port, as GAIE's reference picker (gateways do not verify it): with "
        "--epp-cert-path's certificate, else a self-signed one made at start; --no-epp-secure-serving: plaintext",
    )
    epp.add_argument("--epp-cert-path", metavar="DIR", help="a folder with tls.crt and tls.key (a mounted Secret)")
    epp.add_argument(
        "--epp-fallbacks",
        type=int_at_least(0),
        default=0,
        help="units named after the pick in x-gateway-destination-endpoint, for gateways that go down the list "
        "when the pick refuses connections (Istio); 0, the default: the pick alone, which a standalone Envoy's "
        "ORIGINAL_DST cluster needs",
    )
    epp.add_argument(
        "--epp-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name or IP of the picker for its self-signed certificate (repeatable; default localhost)",
    )
    gateway.add_argument(
        "--shutdown-timeout-seconds",
        type=positive,
        default=25.0,
        help="on SIGTERM, how long requests in flight may take to finish",
    )
    gateway.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="how much it logs"
    )
    gateway.set_defaults(func=_gateway)


def _add_media(parser: argparse.ArgumentParser) -> None:
    """The media URL policy (spec.proxy.media): the proxy's and the gateway's."""
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        type=str.lower,
        metavar="HOST",
        help="the only hosts http(s) media may come from, as vLLM's flag of the same name (an exact match of "
        "the URL's host); listed hosts may be private. Default: any public host",
    )
    parser.add_argument(
        "--media-allow-private-networks",
        action="store_true",
        help="let media URLs name loopback, link-local, private and cluster-internal hosts (refused by default)",
    )


def media_policy(args: argparse.Namespace) -> MediaURLPolicy:

    return MediaURLPolicy(frozenset(args.allowed_media_domains), args.media_allow_private_networks)


def _add_limits(proxy: argparse.ArgumentParser) -> None:
    """The proxy's bounds (docs/proxy.md, "Bounds"): each also a field of spec.proxy."""

    default = Limits()
    proxy.add_argument(
        "--max-request-bytes",
        type=byte_quantity,
        default=default.max_request_bytes,
        help="largest body of a route whose media are primed (chat completions, Responses, ...), which the proxy "
        "holds to read its media: a byte quantity such as 64Mi, the default (OpenAI's 50 MB request limit and "
        "JSON's overhead); other bodies are streamed through whatever their size",
    )
    proxy.add_argument(
        "--max-buffered-bytes",
        type=byte_quantity,
        default=default.max_buffered_bytes,
        help="memory the primed requests being read, parsed and primed may take in all, estimated from each body "
        "before it is parsed (6 bytes a byte of ASCII, 16 otherwise, 100 a JSON value); a request waits its turn "
        "(default 600Mi, under the proxy container's 1Gi limit)",
    )
    proxy.add_argument(
        "--max-media-parts",
        type=positive_int,
        default=default.max_media_parts,
        help="media parts one request may carry, each primed by a request to an encoder (default 32; the "
        "operator renders the consumers' limit_mm_per_prompt when set)",
    )
    proxy.add_argument(
        "--max-json-depth",
        type=positive_int,
        default=default.max_json_depth,
        help="how deep a primed body's JSON may nest (default 64)",
    )
    proxy.add_argument(
        "--max-header-bytes",
        type=byte_quantity,
        default=default.max_header_bytes,
        help="longest request line, header field or trailer field (default 16Ki; over it: 431)",
    )
    proxy.add_argument(
        "--max-headers",
        type=positive_int,
        default=default.max_headers,
        help="header fields of a request and trailer fields of its chunked body, together (default 128)",
    )
    proxy.add_argument(
        "--keepalive-timeout-seconds",
        type=positive,
        default=default.keepalive_timeout_seconds,
        help="close a client connection with no request for this long; a request's head must arrive whole "
        "within this long of the connection opening or of the previous answer (default 75)",
    )
    proxy.add_argument(
        "--body-timeout-seconds",
        type=positive,
        default=default.body_timeout_seconds,
        help="how long the body of a primed route may take to arrive whole (default 60; then 408)",
    )
    proxy.add_argument(
        "--prime-concurrency-per-request",
        type=positive_int,
        default=default.prime_concurrency_per_request,
        help="prime requests of one request in flight at once, so one request's many parts do not hold up "
        "other requests' primes (default 16, of --prime-concurrency in all)",
    )


DESCRIPTION = """\
The data plane of vLLM Encoder-Prefill Disaggregation (EPD): the processes of the pods the
epd-operator makes. Any OpenAI client gets EPD through them: the EPD proxy in each unit primes
every media part on the encoders before forwarding a request; the EPD gateway sends each request
to the unit that holds its media. docs/proxy.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-dataplane", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    _add_proxy_parser(sub)
    _add_gateway_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
