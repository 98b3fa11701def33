"""`epd-operator`: the command line users meet. One argparse tree for every subcommand (the
operator, the processes of its pods, the offline tools), so their --help and errors read alike."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from .argtypes import positive, positive_int
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
            checked.spec,
            name,
            plans,
            args.janitor_image or own_image(),
            operator_namespace=own_namespace(),
            namespace=namespace,
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


DESCRIPTION = """\
The operator for vLLM Encoder-Prefill Disaggregation (EPD): an EPDDeployment (epd.vime.dev/v1alpha1)
becomes EPD units whose encoder engines write image embeddings that their language engines read.

Try a manifest before applying it:
  epd-operator render -f my-epd.yaml           every engine's vLLM command line, checked as the operator checks it
  epd-operator render -f my-epd.yaml --objects the StatefulSets, Services and budgets it would create
  epd-operator convert -f vime.yaml            a Vime `vllm:` config as an EPDDeployment

The operator itself is installed with its Helm chart (charts/epd-operator), which runs
`epd-operator run`; `janitor` runs inside the units' pods (and `epd-dataplane proxy` and
`gateway`, the data plane, beside them).
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
        type=positive,
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
        type=positive_int,
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
