"""`make demo-autoscale`: encoders sized by demand, shown as `make demo` shows EPD.

    python -m epd_dev.demo_autoscale up       # `make demo-down` stops it, as it stops the demo

On the local control plane and its real node (the demo's, in .demo/: a running demo is stopped
first, the machine has one real node): the operator installed by its chart, KEDA and Prometheus
installed as their users install them (epd_dev.localcluster.autoscaling, built from their Go
modules and cached), and a placement Pools model of STAND-IN engines whose encoder pool KEDA
sizes on the proxies' primes in flight (epd_dev.autoscale_demo: the scenario, its load, its
samples). A few clients, a step to many, then none: the pool grows to 3 encoders and shrinks back
to 1, every 2 s printed; then one line with the figures, and everything keeps running with a
KUBECONFIG line to explore.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import yaml

from . import autoscale_demo as scenario
from .demo import DEMO_DIR, GO_BUILDS, SideBySide, banner, down, install_operator, raise_on_termination, start_embedded
from .demo_serving import front_service_url, say
from .images import build as images
from .localcluster import ClusterError, autoscaling, binaries
from .operator_process import get_json, wait_for

NAMESPACE = "epd-autoscale"
IMAGES = ("base", "epd-operator", "vllm-standin")
AUTOSCALING_BUILD = [sys.executable, "-m", "epd_dev.localcluster.build", "--autoscaling"]


def build_missing() -> None:
    """The Go builds (the cluster's, KEDA's and Prometheus') beside the images the scenario runs
    (no vLLM image: its engines are stand-ins); then KEDA's and Prometheus' images."""
    banner("Building what is missing (cached; the first time about 30 min on 2 cores)")
    streams = {}
    if binaries.missing_by_set(binaries.cluster_sets(real_nodes=1)):
        streams["the Go builds of the cluster"] = GO_BUILDS
    streams["the images (base, epd-operator, vllm-standin)"] = [
        sys.executable,
        "-m",
        "epd_dev.images",
        "build",
        *IMAGES,
    ]
    with SideBySide(streams) as builds:
        builds.wait()
    with SideBySide({"KEDA and Prometheus from their Go modules": AUTOSCALING_BUILD}) as builds:
        builds.wait()
    images.Builder().build(images.AUTOSCALING_IMAGES)


def up(root: Path, plot: Path | None = None, figures: Path | None = None, stop: bool = False) -> int:
    began = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    raise_on_termination()
    if down(root):
        say("stopped the previous demo (the machine has one real node)")
    (root / "demo.json").write_text(json.dumps({"kubeconfig": None, "namespace": NAMESPACE}))
    try:
        build_missing()
        cluster = start_embedded(root)
        banner("The operator, KEDA and Prometheus")
        install_operator(cluster, NAMESPACE)
        stack = autoscaling.install(cluster)
        say(
            f"KEDA (namespace {autoscaling.KEDA_NAMESPACE}) and Prometheus ({stack.prometheus_url}) installed in "
            f"{stack.seconds:.0f}s"
        )
        banner("A Pools model whose encoder pool KEDA sizes (stand-in engines: vLLM 0.34 has no CPU build)")
        manifest = scenario.manifest(stack.prometheus_in_cluster)
        path = root / f"{scenario.NAME}.yaml"
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        say(f"kubectl apply -f {path}")
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(path))
        wait_for(
            lambda: (
                (get_json(cluster, "epd", scenario.NAME, "-n", NAMESPACE) or {}).get("status", {}).get("phase")
                == "Ready"
            ),
            300,
            f"epd/{scenario.NAME} Ready",
        )
        wait_for(lambda: scenario.proxies_know_encoders(cluster, NAMESPACE), 60, "the unit's proxy knowing an encoder")
        say(f"epd/{scenario.NAME} Ready: 1 unit, an encoder pool of 1, ScaledObject {scenario.SCALED_OBJECT}")
        phases = ", then ".join(f"{clients} client(s) for {seconds:.0f} s" for _, clients, seconds in scenario.PHASES)
        banner(f"Pictures through the front door (the official openai SDK): {phases}, then none")
        run = scenario.run_scenario(
            cluster, NAMESPACE, front_service_url(cluster, NAMESPACE, scenario.NAME), stack.prometheus_url, say=say
        )
        run.consumer_encodes = scenario.consumer_encodes(cluster, NAMESPACE)
        writers = scenario.replica_writers(cluster, NAMESPACE)
        summary = scenario.summarise(run, int("epd-operator" in writers))
        banner("What happened")
        for message in run.rescales:
            print(f"  HPA {scenario.HPA}: SuccessfulRescale: {message}")
        print(f"  the pool's size written by: {', '.join(f'{m} ({o})' for m, o in writers.items())}")
        print(
            f"  the step to the first new encoder serving: {_seconds(summary.step_to_serving_seconds)}; the signal "
            f"passed its target {_seconds(summary.signal_crossed_at)} after the step, the answers' p90 doubled "
            f"{_seconds(summary.answers_slowed_at)} after it"
        )
        print(
            f"  prime p90: before {_seconds(summary.prime_p90_before)}, at the step's peak "
            f"{_seconds(summary.prime_p90_step_peak)}, once the pool grew {_seconds(summary.prime_p90_after_scale)} "
            f"(target {scenario.PRIME_P90_TARGET_SECONDS} s)"
        )
        print(f"\n{summary.line()}\n")
        if plot is not None:
            scenario.plot(run, summary, plot)
            say(f"plot: {plot}")
        if figures is not None:
            figures.write_text(
                json.dumps(
                    {"summary": dataclasses.asdict(summary), "samples": [dataclasses.asdict(x) for x in run.samples]},
                    indent=1,
                )
            )
            say(f"figures: {figures}")
        if stop:
            down(root)
            say(f"done in {time.monotonic() - began:.0f}s; everything stopped")
            return 0
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        print(f"  kubectl -n {NAMESPACE} get hpa,scaledobject,statefulsets,pods")
        print(f"  kubectl -n {NAMESPACE} get epd {scenario.NAME} -o jsonpath='{{.status.models[0].encoderPool}}'")
        say(f"ready in {time.monotonic() - began:.0f}s; everything keeps running. Stop it all with: make demo-down")
        return 0
    except BaseException as exc:
        if isinstance(exc, (ClusterError, autoscaling.AutoscalingError, AssertionError)):
            say(f"error: {exc}")
        if down(root):
            say("stopped everything the demo had started")
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, (ClusterError, autoscaling.AutoscalingError, AssertionError)):
            return 1
        raise


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_dev.demo_autoscale", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up"])
    parser.add_argument("--plot", type=Path, default=None, help="draw the run into this PNG")
    parser.add_argument("--json", type=Path, default=None, help="write the summary and the samples here")
    parser.add_argument("--down", action="store_true", help="stop everything at the end (make bench-autoscale)")
    args = parser.parse_args(argv)
    return up(Path(DEMO_DIR).resolve(), args.plot, args.json, args.down)


if __name__ == "__main__":
    sys.exit(main())
