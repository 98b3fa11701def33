"""`epd-operator`: the command line users meet. One argparse tree for every subcommand (the
operator, the processes of its pods, the offline tools), so their --help and errors read alike."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .api import PROXY_METRICS_PORT
from .validation import DEFAULT_MAX_GPUS_PER_POD, SpecError


def _load_manifest(path: str) -> dict[str, Any]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    document = yaml.safe_load(text)
    if not isinstance(document, dict):
        raise SpecError([f"{path}: expected one YAML mapping"])
    return document


def _render(args: argparse.Namespace) -> None:
    from .render import commands_json, format_commands, render
    from .resources import desired_children
    from .settings import own_image, own_namespace
    from .validation import validate

    manifest = _load_manifest(args.file)
    metadata = manifest.get("metadata", {})
    name, namespace = metadata.get("name", "epd"), metadata.get("namespace", args.namespace)
    checked = validate(manifest.get("spec", {}), name=name)
    plans = render(checked, namespace=namespace, name=name, uid=metadata.get("uid", args.uid))
    if args.objects:
        # What the operator would create, for review and scanners (it adds ownerReferences
        # to its EPDDeployment and a spec-hash annotation, which depend on the live object).
        children = desired_children(
            checked.spec, name, plans, args.janitor_image or own_image(), operator_namespace=own_namespace()
        )
        for child in children:
            child["metadata"]["namespace"] = namespace
        print(yaml.safe_dump_all(children, sort_keys=False), end="")
    elif args.output == "json":
        print(json.dumps(commands_json(plans), indent=2))
    else:
        print(format_commands(plans))


def _convert(args: argparse.Namespace) -> None:
    from .convert import vime_to_manifest

    conversion = vime_to_manifest(
        _load_manifest(args.file),
        name=args.name,
        image=args.image,
        hf_checkpoint=args.hf_checkpoint,
        num_gpus_per_engine=args.num_gpus_per_engine,
        vllm_version=args.vllm_version,
        namespace=args.namespace,
    )
    # Notes on stderr: stdout stays a manifest to pipe into kubectl.
    for note in conversion.notes:
        print(f"note: {note}", file=sys.stderr)
    print(yaml.safe_dump(conversion.manifest, sort_keys=False), end="")


def _crds(args: argparse.Namespace) -> None:
    from .crd import render_crd_yaml

    print(render_crd_yaml(), end="")


def _run(args: argparse.Namespace) -> None:
    from .runner import run
    from .settings import Settings, own_image, own_namespace
    from .validation import Limits

    run(
        namespaces=args.namespace,
        all_namespaces=args.all_namespaces,
        peering=args.peering,
        standalone=args.standalone,
        priority=args.priority,
        liveness=args.liveness,
        metrics_port=args.metrics_port,
        settings=Settings(
            janitor_image=args.janitor_image or own_image(),
            janitor_scrape_interval=args.janitor_scrape_interval,
            janitor_scrape_rate=args.janitor_scrape_rate,
            limits=Limits(max_gpus_per_pod=args.max_gpus_per_pod),
            operator_namespace=own_namespace(),
        ),
        log_level=args.log_level,
        log_format=args.log_format,
    )


def _janitor(args: argparse.Namespace) -> None:
    from .ec.janitor import run_janitor

    run_janitor(
        paths=args.path,
        max_bytes=args.max_bytes,
        ttl_seconds=args.ttl_seconds,
        interval_seconds=args.interval,
        metrics_port=args.metrics_port,
    )


def _proxy(args: argparse.Namespace) -> None:
    from .proxy.encoders import Ejection
    from .proxy.server import run_proxy

    limits = proxy_limits(args)

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
        limits=limits,
        pooled=args.placement == "Pools",
        ec_store=args.ec_store,
        require_weights_version=args.require_weights_version,
        shutdown_timeout_seconds=args.shutdown_timeout_seconds,
        log_level=args.log_level,
        media=media_policy(args),
    )


def _gateway(args: argparse.Namespace) -> None:
    from .proxy.gateway import parse_units, run_gateway

    try:
        units = parse_units(args.unit)
    except ValueError as error:
        raise SystemExit(f"epd-operator gateway: {error}") from None
    if not units and not (args.namespace and args.deployment and args.units_service):
        raise SystemExit(
            "epd-operator gateway: give --namespace, --deployment and --units-service (the gateway watches them), "
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
    )


def proxy_limits(args: argparse.Namespace) -> Any:
    """The proxy's Limits from its flags; exits with the rule broken when they do not fit."""
    from .proxy_limits import Limits

    try:
        return Limits(**{name: getattr(args, name) for name in Limits.__dataclass_fields__})
    except ValueError as error:
        raise SystemExit(f"epd-operator proxy: {error}") from None


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:  # nan too
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {text}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def _bytes(text: str) -> int:
    from .ec.quantity import parse_quantity

    try:
        return parse_quantity(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _dns_target(text: str) -> str:
    from .proxy.core import DNSTarget

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
    proxy.add_argument("--port", type=_port, default=8000, help="port to listen on: the one the front Service targets")
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
        type=_positive,
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
        "--metrics-port", type=_port, default=PROXY_METRICS_PORT, help="port of the proxy's own /metrics and /health"
    )
    proxy.add_argument(
        "--request-timeout-seconds",
        type=_positive,
        default=1800.0,
        help="limit of one forwarded request, streaming included (vllm-router's default)",
    )
    proxy.add_argument(
        "--prime-timeout-seconds",
        type=_positive,
        default=600.0,
        help="limit of priming one media part, retries included (epd_client's deadline)",
    )
    proxy.add_argument(
        "--prime-attempt-timeout-seconds",
        type=_positive,
        default=None,
        help="limit of one prime request to one encoder, then retried on the next encoder (default: epd_client's, "
        "300; at most --prime-timeout-seconds counts)",
    )
    proxy.add_argument(
        "--prime-max-attempts", type=_positive_int, default=20, help="attempts per media part (epd_client's)"
    )
    proxy.add_argument(
        "--eject-after-failures",
        type=_int_at_least(0),
        help="leave an encoder out of priming after this many failed prime requests in a row (no answer in time, "
        "no connection, a 5xx); 0: never (default: 5, Envoy's consecutive gateway failures)",
    )
    proxy.add_argument(
        "--ejection-base-seconds",
        type=_positive,
        help="how long an encoder is left out, times the number of times in a row it was (default: 30)",
    )
    proxy.add_argument(
        "--ejection-max-seconds", type=_positive, help="the longest an encoder is left out (default: 300)"
    )
    proxy.add_argument(
        "--prime-concurrency", type=_positive_int, default=64, help="prime requests in flight at once, at most"
    )
    _add_limits(proxy)
    proxy.add_argument(
        "--shutdown-timeout-seconds",
        type=_positive,
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
        "Example: epd-operator gateway --namespace team-a --deployment demo --model actor "
        "--units-service demo-actor-units. docs/proxy.md.",
    )
    gateway.add_argument("--host", default="0.0.0.0", help="address to listen on")
    gateway.add_argument(
        "--port", type=_port, default=8000, help="port to listen on: the one the front Service targets"
    )
    gateway.add_argument(
        "--metrics-port", type=_port, default=PROXY_METRICS_PORT, help="port of the gateway's /metrics, /health, /ready"
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
        type=_int_at_least(100),
        default=125,
        help="the most requests in flight a unit takes, in percent of the mean over the ready units, before a "
        "request goes to its key's next unit (bounded-load hashing)",
    )
    gateway.add_argument(
        "--request-timeout-seconds",
        type=_positive,
        default=1800.0,
        help="limit of one forwarded request, streaming included (vllm-router's default)",
    )
    _add_limits(gateway)
    _add_media(gateway)
    gateway.add_argument(
        "--shutdown-timeout-seconds",
        type=_positive,
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


def media_policy(args: argparse.Namespace) -> Any:
    from .proxy.media_urls import MediaURLPolicy

    return MediaURLPolicy(frozenset(args.allowed_media_domains), args.media_allow_private_networks)


def _add_limits(proxy: argparse.ArgumentParser) -> None:
    """The proxy's bounds (docs/proxy.md, "Bounds"): each also a field of spec.proxy."""
    from .proxy_limits import Limits

    default = Limits()
    proxy.add_argument(
        "--max-request-bytes",
        type=_bytes,
        default=default.max_request_bytes,
        help="largest body of a route whose media are primed (chat completions, Responses, ...), which the proxy "
        "holds to read its media: a byte quantity such as 64Mi, the default (OpenAI's 50 MB request limit and "
        "JSON's overhead); other bodies are streamed through whatever their size",
    )
    proxy.add_argument(
        "--max-buffered-bytes",
        type=_bytes,
        default=default.max_buffered_bytes,
        help="memory the primed requests being read, parsed and primed may take in all, estimated from each body "
        "before it is parsed (6 bytes a byte of ASCII, 16 otherwise, 100 a JSON value); a request waits its turn "
        "(default 600Mi, under the proxy container's 1Gi limit)",
    )
    proxy.add_argument(
        "--max-media-parts",
        type=_positive_int,
        default=default.max_media_parts,
        help="media parts one request may carry, each primed by a request to an encoder (default 32; the "
        "operator renders the consumers' limit_mm_per_prompt when set)",
    )
    proxy.add_argument(
        "--max-json-depth",
        type=_positive_int,
        default=default.max_json_depth,
        help="how deep a primed body's JSON may nest (default 64)",
    )
    proxy.add_argument(
        "--max-header-bytes",
        type=_bytes,
        default=default.max_header_bytes,
        help="longest request line, header field or trailer field (default 16Ki; over it: 431)",
    )
    proxy.add_argument(
        "--max-headers",
        type=_positive_int,
        default=default.max_headers,
        help="header fields of a request and trailer fields of its chunked body, together (default 128)",
    )
    proxy.add_argument(
        "--keepalive-timeout-seconds",
        type=_positive,
        default=default.keepalive_timeout_seconds,
        help="close a client connection with no request for this long; a request's head must arrive whole "
        "within this long of the connection opening or of the previous answer (default 75)",
    )
    proxy.add_argument(
        "--body-timeout-seconds",
        type=_positive,
        default=default.body_timeout_seconds,
        help="how long the body of a primed route may take to arrive whole (default 60; then 408)",
    )
    proxy.add_argument(
        "--prime-concurrency-per-request",
        type=_positive_int,
        default=default.prime_concurrency_per_request,
        help="prime requests of one request in flight at once, so one request's many parts do not hold up "
        "other requests' primes (default 16, of --prime-concurrency in all)",
    )


DESCRIPTION = """\
The operator for vLLM Encoder-Prefill Disaggregation (EPD): an EPDDeployment (epd.vime.dev/v1alpha1)
becomes EPD units whose encoder engines write image embeddings that their language engines read.

Try a manifest before applying it:
  epd-operator render -f my-epd.yaml           every engine's vLLM command line, checked as the operator checks it
  epd-operator render -f my-epd.yaml --objects the StatefulSets, Services and budgets it would create
  epd-operator convert -f vime.yaml            a Vime `vllm:` config as an EPDDeployment

The operator itself is installed with its Helm chart (charts/epd-operator), which runs
`epd-operator run`; `janitor` and `proxy` run inside the units' pods.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-operator",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`epd-operator <command> --help` says more about each. Docs: docs/api.md, docs/rendering.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")

    run = sub.add_parser(
        "run",
        help="run the operator (what the Helm chart's Deployment runs)",
        description="Reconcile the EPDDeployments of the watched namespaces: validate each spec, render its "
        "engines' vLLM commands, and create and keep its units (StatefulSets, Services, budgets), reporting "
        "in status.conditions and Events. Uses the in-cluster credentials, else $KUBECONFIG. Built on kopf.",
    )
    run.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    run.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    run.add_argument("--peering", default=None, help="kopf peering name for leader election among replicas")
    run.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    run.add_argument(
        "--priority",
        default="0",
        help="peering priority: the highest live peer works, the others stand by; 'random' gives "
        "each replica its own (kopf pauses every peer while two share the top priority)",
    )
    run.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="where the liveness probe's /healthz is served"
    )
    run.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    run.add_argument(
        "--janitor-scrape-interval",
        type=float,
        default=30.0,
        help="seconds between scrapes of the units' EC janitors, which turn budget evictions and "
        "consumers' fallback encodes into ECEvicted and ECFallbackEncodes Events and "
        "status.models[].units[].ecEvictions and .fallbackEncodes (0: off)",
    )
    run.add_argument(
        "--janitor-scrape-rate",
        type=_positive,
        default=10.0,
        help="janitors scraped a second at most, which bounds the scrape's CPU however many units "
        "there are: a round of N units takes N / rate seconds",
    )
    run.add_argument(
        "--janitor-image",
        default=None,
        help="image of each unit's EC janitor container, which runs `epd-operator janitor` (default: "
        "$EPD_OPERATOR_IMAGE, which the Helm chart sets to the operator's own image, else epd-operator:<version>)",
    )
    run.add_argument(
        "--max-gpus-per-pod",
        type=_positive_int,
        default=DEFAULT_MAX_GPUS_PER_POD,
        help="refuse specs whose unit or encoder pool pods would request more GPUs (no node has more; "
        f"default {DEFAULT_MAX_GPUS_PER_POD})",
    )
    run.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="DEBUG also logs every handler kopf runs",
    )
    run.add_argument(
        "--log-format",
        default="plain",
        choices=["plain", "full", "json"],
        help="json: one object a line, with the EPDDeployment's namespace/name under `epd`",
    )
    run.set_defaults(func=_run)

    render = sub.add_parser(
        "render",
        help="print every engine's and router's command line, or the objects the operator would create",
        description="Validate an EPDDeployment as the operator does (the same rules, the same messages) and print "
        "what it makes of it: each engine's `vllm serve` command and environment, each router's command, or with "
        "--objects the Kubernetes objects. Nothing is sent to a cluster. Example: epd-operator render -f "
        "docs/examples/encoder-prefill-decode.yaml",
    )
    render.add_argument("-f", "--file", required=True, help="EPDDeployment manifest ('-' for stdin)")
    render.add_argument(
        "-o",
        "--output",
        choices=["text", "json"],
        default="text",
        help="text: a shell-like listing per unit; json: the same as data, for scripts",
    )
    render.add_argument(
        "--objects",
        action="store_true",
        help="print the objects the operator would create (StatefulSets, Services, budgets, ...) as YAML",
    )
    render.add_argument(
        "--janitor-image", default=None, help="the EC janitor's image in --objects (default: as `run` picks it)"
    )
    render.add_argument("--namespace", default="default", help="namespace when the manifest has none")
    render.add_argument(
        "--uid",
        default="00000000-0000-0000-0000-000000000000",
        help="the EPDDeployment's uid to assume when the manifest has none (it names the EC store folders)",
    )
    render.set_defaults(func=_render)

    convert = sub.add_parser(
        "convert",
        help="turn a Vime `vllm:` config into an EPDDeployment",
        description="Read a Vime rollout config (its `vllm:` list of models and server groups) and print the "
        "EPDDeployment that runs the same topology, ready for kubectl apply; what does not carry over is said on "
        "stderr as `note:` lines. Example: epd-operator convert -f vime.yaml --name rollout | kubectl apply -f -",
    )
    convert.add_argument("-f", "--file", required=True, help="Vime config YAML ('-' for stdin)")
    convert.add_argument("--name", default="vime", help="EPDDeployment name")
    convert.add_argument("--image", default="vllm/vllm-openai:v0.34.0", help="the vLLM image of every engine")
    convert.add_argument(
        "--hf-checkpoint",
        "--model",
        default=None,
        help="Vime's --hf-checkpoint: the model path of entries without model_path, and of the models "
        "that receive weight updates when update_weights is not set",
    )
    convert.add_argument(
        "--num-gpus-per-engine",
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        help="Vime's --rollout-num-gpus-per-engine: GPUs per engine of groups whose group and model set none",
    )
    convert.add_argument("--vllm-version", default=None, help="spec.vllmVersion, when the image tag does not tell")
    convert.add_argument("--namespace", default=None, help="metadata.namespace of the EPDDeployment (default: none)")
    convert.set_defaults(func=_convert)

    crds = sub.add_parser(
        "crds",
        help="print the EPDDeployment CustomResourceDefinition",
        description="Print the CRD the operator serves, generated from its API models (the Helm chart installs the "
        "same one): epd-operator crds | kubectl apply --server-side -f -",
    )
    crds.set_defaults(func=_crds)

    janitor = sub.add_parser(
        "janitor",
        help="keep a unit's EC stores under a byte budget (runs in each unit's pod)",
        description="Keep EC store folders (the encoders' embeddings, one folder per media hash) under a byte "
        "budget: remove abandoned entries, those older than --ttl-seconds, then the oldest until the stores fit "
        "--max-bytes; count the consumers' fallback encodes (empty folders). The operator adds it to every unit "
        "(spec.ecStorage); docs/ec-storage.md.",
    )
    janitor.add_argument("--path", action="append", required=True, help="an EC store folder (repeatable)")
    janitor.add_argument(
        "--max-bytes", type=int, required=True, help="the stores' byte budget: the oldest entries go first"
    )
    janitor.add_argument(
        "--ttl-seconds", type=int, default=None, help="also remove entries this old (default: no age limit)"
    )
    janitor.add_argument("--interval", type=float, default=2.0, help="seconds between two passes over the stores")
    janitor.add_argument(
        "--metrics-port", type=int, default=0, help="serve /metrics (evictions, bytes, fallback encodes) here (0: off)"
    )
    janitor.set_defaults(func=_janitor)

    _add_proxy_parser(sub)
    _add_gateway_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SpecError as error:
        print(f"error: invalid {'Vime config' if args.command == 'convert' else 'EPDDeployment'}:", file=sys.stderr)
        for message in error.errors:
            print(f"  - {message}", file=sys.stderr)
        return 1
    except (OSError, yaml.YAMLError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
