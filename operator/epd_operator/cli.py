"""`epd-operator`: run the operator, and offline tools (render, convert, crds) for people."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

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


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the operator (wraps kopf)")
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
    run.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
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
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument("--log-format", default="plain", choices=["plain", "full", "json"])
    run.set_defaults(func=_run)

    render = sub.add_parser("render", help="print every engine's and router's command line, or the objects")
    render.add_argument("-f", "--file", required=True, help="EPDDeployment manifest ('-' for stdin)")
    render.add_argument("-o", "--output", choices=["text", "json"], default="text")
    render.add_argument(
        "--objects",
        action="store_true",
        help="print the objects the operator would create (StatefulSets, Services, budgets, ...) as YAML",
    )
    render.add_argument(
        "--janitor-image", default=None, help="the EC janitor's image in --objects (default: as `run` picks it)"
    )
    render.add_argument("--namespace", default="default", help="namespace when the manifest has none")
    render.add_argument("--uid", default="00000000-0000-0000-0000-000000000000", help="object uid to assume")
    render.set_defaults(func=_render)

    convert = sub.add_parser("convert", help="turn a Vime `vllm:` config into an EPDDeployment")
    convert.add_argument("-f", "--file", required=True, help="Vime config YAML ('-' for stdin)")
    convert.add_argument("--name", default="vime", help="EPDDeployment name")
    convert.add_argument("--image", default="vllm/vllm-openai:v0.33.0", help="vLLM image")
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
    convert.add_argument("--namespace", default=None)
    convert.set_defaults(func=_convert)

    crds = sub.add_parser("crds", help="print the generated CustomResourceDefinition")
    crds.set_defaults(func=_crds)

    janitor = sub.add_parser("janitor", help="keep EC stores under a byte budget (runs in each unit)")
    janitor.add_argument("--path", action="append", required=True, help="an EC store folder (repeatable)")
    janitor.add_argument("--max-bytes", type=int, required=True)
    janitor.add_argument("--ttl-seconds", type=int, default=None)
    janitor.add_argument("--interval", type=float, default=2.0)
    janitor.add_argument("--metrics-port", type=int, default=0)
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
