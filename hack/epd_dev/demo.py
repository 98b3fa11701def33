"""`make demo`: the operator on a local control plane, then one real multimodal request through
the pod it made on a real node.

    python -m epd_dev.demo up [--kubeconfig FILE]
    python -m epd_dev.demo down

SIMULATED: the control plane (upstream binaries, built once) with four kwok GPU nodes, the
operator (helm install, its pod on the real node), and the seed's two topologies of
Qwen2.5-VL-7B: kwok plays those nodes' kubelets, nothing runs.

REAL: a tiny LLaVA-style model as the seed's second topology (encoder + prefill + decode behind
vllm-router), and an aggregated engine of the same model to compare with, on the real node
epd-real-0: its kubelet runs the operator's pods in containerd, with real vLLM in the local
images. One request with two images goes through epd_client (prime -> render -> generate)
(epd_dev.demo_serving).

Everything keeps running for exploration; `down` (another process, Ctrl-C or a failure) removes
the release, the namespace and the cluster with its node. With --kubeconfig an existing cluster
replaces the embedded one for the SIMULATED part, in its own namespace, with the operator as a
process here, and the REAL part is skipped: that cluster's pods are its own kubelets' job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import yaml

from epd_client import EPDClientError, discover

from . import demo_serving, operator_chart, paths
from .demo_serving import print_explore, say
from .images import build as images
from .localcluster import ClusterError, LocalCluster, binaries
from .operator_process import OperatorProcess, get_json, group_members, install_crd, wait_for
from .vllm import envs, real_node, tiny_model

DEMO_DIR = ".demo"
# While the first run builds vLLM's image: the SIMULATED part on a cluster of its own (`preview`).
PREVIEW_DIR = "preview"
NAMESPACE = "epd-demo"
SEEDS = ("encoder-regular.yaml", "encoder-prefill-decode.yaml")
ENVS = ["serve", "router"]
# The demo's two build streams (build_missing), as `make test` runs them side by side.
GO_BUILDS = [sys.executable, "-m", "epd_dev.localcluster.build", "--real-nodes", "1"]
IMAGES_BESIDE_GO = [sys.executable, "-m", "epd_dev.images", "build", "--without-go"]
# The local model's PersistentVolume and claim (a PV is cluster-wide).
MODEL_CLAIM = "tiny-llava-model"
# Measured (PSS of each engine's processes, serving): prefill, decode and the reference 2.3 GB
# each (the 1 GiB KV cache of VLLM_CPU_KVCACHE_SPACE=1 included), the encoder 1.2 GB; 7.5 GiB in
# all, and some slack for loading.
GIB_PER_ENGINE = 2.25
ENGINES = 4  # encoder, prefill, decode, aggregated reference


class DemoError(RuntimeError):
    """A situation the user must fix; the message says how."""


def banner(title: str) -> None:
    print(f"\n===== {title} =====", flush=True)


# --------------------------------------------------------------------------- preflight


def check_memory(engines_needed: int, meminfo: Path = Path("/proc/meminfo")) -> None:
    """Enough available memory for the engines, before any of them (or anything else) starts."""
    available_kib = next(
        int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:")
    )
    available, needed = available_kib / 2**20, engines_needed * GIB_PER_ENGINE
    if available < needed:
        raise DemoError(
            f"not enough memory: the demo's {engines_needed} vLLM engines need about {needed:.0f} GiB "
            f"({GIB_PER_ENGINE} GiB each), {available:.1f} GiB is available. Stop other work (another "
            "demo: make demo-down; test runs), or run only the simulated part against a cluster: "
            "make demo DEMO_KUBECONFIG=<file>"
        )


def check_cache_writable(wanted: dict[str, Path]) -> None:
    """Each cache folder something must be written into (`wanted`: what -> folder) is writable
    by this user, or can be created; a complete cache is only read."""
    for what, folder in wanted.items():
        existing = folder
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise DemoError(
                f"{what} must be installed into {folder}, but {existing} is not a folder you can "
                f"write (uid {os.getuid()}). Fix its owner (sudo chown -R $(id -u) {existing}) or "
                f"point the cache elsewhere: make demo EPD_CACHE=/a/writable/folder"
            )


def missing_caches(runs_engines: bool) -> dict[str, Path]:
    """What `up` would install or build, and the cache folder it goes to."""
    wanted = {}
    for bset, names in binaries.missing_by_set(binaries.cluster_sets(real_nodes=1 if runs_engines else 0)).items():
        wanted[f"{', '.join(names)} (make cluster)"] = binaries.cache_dir(bset)
    if runs_engines:
        builder = images.Builder()
        # Without the control plane's build there is no Go module cache to key the pause image by.
        if binaries.missing_binaries() or any(builder.cached(name) is None for name in images.ALL):
            wanted["the node's images (make images)"] = builder.root
        for name in ENVS:
            if not (envs.env_dir(name) / envs.MARKER).is_file():
                wanted[f"the vLLM venv {name!r}"] = envs.env_dir(name)
        if not (tiny_model.cached_path() / envs.MARKER).is_file():
            wanted["the tiny model"] = tiny_model.cached_path()
    return wanted


# --------------------------------------------------------------------------- clusters


class ExistingCluster:
    """kubectl against a cluster the demo did not start (kind, k3d, a real one)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.kubectl_binary = binaries.bin_dir() / "kubectl"

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.kubectl_binary), "--kubeconfig", str(self.kubeconfig), *args]
        out = subprocess.run(cmd, check=False, input=input, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out


def _start_operator(kubeconfig: Path, root: Path, watch: list[str]) -> OperatorProcess:
    operator = OperatorProcess(kubeconfig, root, extra_args=watch)
    operator.start()
    assert operator.proc is not None
    (root / "operator.pid").write_text(str(operator.proc.pid))
    say(f"operator running (pid {operator.proc.pid}, {' '.join(watch)}, log {operator.log_path})")
    return operator


def _stop_operator(root: Path) -> bool:
    """SIGTERM the recorded operator's process group and wait until it is gone."""
    pid_file = root / "operator.pid"
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text())
    pid_file.unlink()
    try:
        if b"epd_operator.cli" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False  # gone, and the pid is someone else's now
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        return False
    deadline = time.monotonic() + 15
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return True


def _ensure_namespace(cluster: Any, namespace: str, labels: dict[str, str] | None = None) -> None:
    metadata = {"name": namespace, **({"labels": labels} if labels else {})}
    cluster.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": metadata})
    )
    wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0,
        60,
        f"namespace {namespace}",
    )


def _seed_names() -> tuple[str, ...]:
    return tuple(
        yaml.safe_load((paths.REPO / "docs" / "examples" / seed).read_text())["metadata"]["name"] for seed in SEEDS
    )


def _apply_seeds(cluster: Any, namespace: str, label: str) -> None:
    for seed in SEEDS:
        say(f"{label}  kubectl apply -n {namespace} -f docs/examples/{seed}")
        cluster.kubectl("apply", "-n", namespace, "-f", str(paths.REPO / "docs" / "examples" / seed))


def _wait_reconciled(cluster: Any, namespace: str, operator_log: Callable[[], str], ready_within: float) -> bool:
    """Every EPDDeployment's status written for its generation; then Ready within `ready_within`
    seconds (False if not: an existing cluster may have no GPU nodes for them)."""

    def reconciled() -> bool:
        items = get_json(cluster, "epd", "-n", namespace)["items"]
        return bool(items) and all(
            i.get("status", {}).get("observedGeneration") == i["metadata"]["generation"] for i in items
        )

    wait_for(reconciled, 120, "the operator to reconcile the EPDDeployments", operator_log)
    names = [f"epd/{name}" for name in _seed_names()]
    say(f"kubectl wait --for=condition=Ready {' '.join(names)} -n {namespace}")
    out = cluster.kubectl(
        "wait",
        "--for=condition=Ready",
        *names,
        "-n",
        namespace,
        f"--timeout={ready_within:.0f}s",
        check=False,
        timeout=ready_within + 10,
    )
    return out.returncode == 0


def _print_units(cluster: Any, namespace: str, label: str, names: tuple[str, ...]) -> None:
    """Each unit as a client finds it (`discover`: the status and the units' EndpointSlices),
    and why it is not ready as the status says."""
    items = get_json(cluster, "epd", "-n", namespace)["items"]
    rows = [("", "DEPLOYMENT", "UNIT", "NODE", "READY", "WHY NOT", "ENCODERS", "ENTRY (proxy, router or consumer)")]
    for item in items:
        name = item["metadata"]["name"]
        if name not in names:
            continue
        try:
            endpoints = discover(name, namespace, kubeconfig=str(cluster.kubeconfig))
        except EPDClientError as error:
            rows.append((label, name, "-", "-", "False", str(error), "", ""))
            continue
        for model in endpoints.models:
            status = next(m for m in item["status"]["models"] if m["name"] == model.name)
            why = {u["name"]: u["reason"] for u in status.get("unready") or []}
            for unit in model.units:
                rows.append(
                    (
                        label,
                        name,
                        unit.name,
                        unit.node or "-",
                        str(unit.ready),
                        why.get(unit.name, ""),
                        ", ".join(unit.encoder_urls),
                        unit.entry_url or "",
                    )
                )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def simulated_part(cluster: Any, namespace: str, operator_log: Callable[[], str], *, embedded: bool) -> None:
    """The seed's two topologies. On the embedded cluster kwok plays their kubelets; an
    existing cluster's nodes run them (or say why they cannot)."""
    label = "SIMULATED" if embedded else "CLUSTER"
    _apply_seeds(cluster, namespace, label)
    ready_within = 180 if embedded else 60
    say(f"{label}  waiting for the operator to reconcile both ...")
    ready = _wait_reconciled(cluster, namespace, operator_log, ready_within)
    if embedded and not ready:
        raise DemoError(
            f"the seed's EPDDeployments did not become Ready within {ready_within}s on kwok's "
            f"nodes; the operator's log says why:\n{operator_log()}"
        )
    print()
    print(cluster.kubectl("get", "epd", *_seed_names(), "-n", namespace, "-o", "wide").stdout)
    _print_units(cluster, namespace, label, _seed_names())
    print()
    if embedded:
        say(
            "SIMULATED  both Ready: their pods are bound to fake nodes (nvidia.com/gpu: 8 each) and kwok "
            "reports them running. No vLLM process runs for them."
        )
    elif ready:
        say("CLUSTER  both Ready: the cluster's nodes run them.")
    else:
        say(
            f"CLUSTER  not Ready within {ready_within}s: their pods need nodes with nvidia.com/gpu and pull "
            "vllm/vllm-openai; the WHY NOT column and `kubectl describe pod` say what is missing."
        )


# --------------------------------------------------------------------------- up / down


def build_missing(root: Path) -> None:
    """What the embedded run needs and the cache lacks, as `make test` builds it: the Go builds
    (binaries.cluster_sets: the control plane, the node's kubelet, kube-proxy and kube-router)
    beside the images that need none of them (the vLLM venvs first), then the pause image and the
    tiny model. Each stream prints its own progress. While vLLM's image builds (the first run), the
    SIMULATED part is shown as soon as the control plane is built (`preview`)."""
    banner("Building what is missing (cached in " + str(paths.cache_root()) + ")")
    streams = {"the images (vLLM venvs, base, vllm-cpu, vllm-router, epd-operator, envoy)": IMAGES_BESIDE_GO}
    if binaries.missing_by_set(binaries.cluster_sets(real_nodes=1)):
        streams = {"the Go builds (control plane, kubelet, kube-proxy, kube-router)": GO_BUILDS, **streams}
    long_build = images.Builder().cached("vllm-cpu") is None
    with SideBySide(streams) as builds:
        while binaries.missing_binaries() and builds.running():
            time.sleep(1)
        if long_build and builds.running():
            preview(root)
        builds.wait()
    stop_preview(root)
    started = time.monotonic()
    images.Builder().build()
    envs.install(ENVS)  # the image builds installed them, unless the images were cached already
    say(f"tiny model: {tiny_model.tiny_model_path()} ({time.monotonic() - started:.0f}s with the pause image)")
    say("images: " + ", ".join(images.Builder().image(name).ref for name in images.ALL))


class SideBySide:
    """Commands run at once, their output going to the terminal. Leaving the block early (an
    error, Ctrl-C) stops those still running as Ctrl-C stops them."""

    def __init__(self, commands: dict[str, list[str]]) -> None:
        self.commands = commands
        self.began = time.monotonic()
        self._running: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Self:
        self._running = {what: subprocess.Popen(cmd, cwd=paths.REPO) for what, cmd in self.commands.items()}
        return self

    def running(self) -> bool:
        """Whether any still runs; says when one is done, raises DemoError when one failed."""
        for what, proc in list(self._running.items()):
            if proc.poll() is None:
                continue
            del self._running[what]
            if proc.returncode != 0:
                raise DemoError(f"building {what} failed (exit {proc.returncode}); its output is above")
            say(f"built {what} in {time.monotonic() - self.began:.0f}s")
        return bool(self._running)

    def wait(self) -> None:
        while self.running():
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        for proc in self._running.values():
            proc.send_signal(signal.SIGINT)
        for proc in self._running.values():
            proc.wait()


def preview(root: Path) -> None:
    """The SIMULATED part while the rest builds, on a control plane of its own with kwok's GPU
    nodes and no real node, the operator running here as a process (its image may not be built
    yet). It stops once the builds are done; the full run shows the same part again."""
    banner("SIMULATED, while the rest builds: the operator and the seed's two topologies on kwok's fake GPU nodes")
    say("starting a control plane with 4 kwok GPU nodes (no real node yet) ...")
    cluster = LocalCluster(root / PREVIEW_DIR, nodes=4, real_nodes=0).start()
    install_crd(cluster)
    _ensure_namespace(cluster, NAMESPACE)
    operator = _start_operator(cluster.kubeconfig, root, ["--namespace", NAMESPACE])
    simulated_part(cluster, NAMESPACE, operator.tail, embedded=True)
    say(
        f"SIMULATED  try it meanwhile: KUBECONFIG={cluster.kubeconfig} {cluster.dir / 'bin' / 'kubectl'} get epd "
        f"-n {NAMESPACE} -o wide. The REAL part follows once the images are built; this preview stops then."
    )


def stop_preview(root: Path) -> bool:
    """Stop the preview's operator and control plane, if it runs; whether it did."""
    preview_cluster = LocalCluster(root / PREVIEW_DIR)
    if not preview_cluster.state_file.exists():
        return False
    _stop_operator(root)
    preview_cluster.stop()
    return True


def start_embedded(root: Path) -> LocalCluster:
    """The control plane, kwok's GPU nodes and the real node, with the images imported."""
    say("starting the control plane, 4 kwok GPU nodes and the real node epd-real-0 ...")
    return LocalCluster(root / "cluster", nodes=4, real_nodes=1, on_node_runtime=images.import_into).start()


def install_operator(cluster: LocalCluster, namespace: str) -> Callable[[], str]:
    """helm install into `namespace` (Pod Security restricted); returns how to read its log."""
    _ensure_namespace(cluster, namespace, {"pod-security.kubernetes.io/enforce": "restricted"})
    say(
        f"helm install {operator_chart.RELEASE} charts/epd-operator -n {namespace} "
        "(image localhost/epd-operator:dev, on epd-real-0, watching this namespace, with the InferencePool CRD)"
    )
    # The demo's model has an InferencePool: the chart installs GAIE's CRD when asked.
    pod = operator_chart.install(
        cluster, namespace, operator_chart.values([namespace], **{"inferencePoolCRD.install": True})
    )
    say(f"operator running in pod {pod['metadata']['name']} on {pod['spec']['nodeName']}")

    def log() -> str:
        deployment = f"deploy/{demo_serving.OPERATOR_DEPLOYMENT}"
        return cluster.kubectl("logs", "-n", namespace, deployment, "--tail=60", check=False).stdout

    return log


def model_claim(cluster: LocalCluster, namespace: str) -> str:
    """The tiny model on a local PersistentVolume of the real node, and a claim bound to it."""
    objects = real_node.model_volume(MODEL_CLAIM, tiny_model.tiny_model_path())
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects))
    return MODEL_CLAIM


def up(root: Path, kubeconfig: Path | None = None) -> int:
    began = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    raise_on_termination()
    if down(root):  # a previous demo: its node is the machine's only one
        say("stopped the previous demo")
    (root / "demo.json").write_text(
        json.dumps({"kubeconfig": str(kubeconfig) if kubeconfig else None, "namespace": NAMESPACE})
    )
    try:
        embedded = kubeconfig is None
        check_cache_writable(missing_caches(embedded))
        if not embedded:
            assert kubeconfig is not None
            if binaries.missing_binaries():
                binaries.build()
            cluster: Any = ExistingCluster(kubeconfig)
            say(f"using the existing cluster of {kubeconfig} (namespace {NAMESPACE}; the REAL part is skipped)")
            banner(f"CLUSTER: the operator and the seed's two topologies on {kubeconfig}")
            install_crd(cluster)
            _ensure_namespace(cluster, NAMESPACE)
            # On someone else's cluster, watch only the demo's namespace: an operator installed
            # there owns the others.
            operator = _start_operator(kubeconfig, root, ["--namespace", NAMESPACE])
            simulated_part(cluster, NAMESPACE, operator.tail, embedded=False)
            say(
                f"ready in {time.monotonic() - began:.0f}s. Try: kubectl --kubeconfig {kubeconfig} -n {NAMESPACE} "
                "get epd,statefulsets,pods. Stop (and delete the namespace) with: make demo-down"
            )
            return 0
        check_memory(ENGINES)
        build_missing(root)
        cluster = start_embedded(root)
        banner("SIMULATED: the operator and the seed's two topologies on kwok's fake GPU nodes")
        operator_log = install_operator(cluster, NAMESPACE)
        claim = model_claim(cluster, NAMESPACE)
        say("REAL  applying the tiny model's two EPDDeployments first: the real node loads them meanwhile")
        demo_serving.apply(cluster, root, NAMESPACE, claim)
        simulated_part(cluster, NAMESPACE, operator_log, embedded=True)
        banner("REAL: the operator's pods for a tiny LLaVA model on the real node epd-real-0, real vLLM")
        answer = demo_serving.serve(cluster, NAMESPACE)
        print_explore(answer, cluster, NAMESPACE)
        say(f"ready in {time.monotonic() - began:.0f}s; everything keeps running. Stop it all with: make demo-down")
        return 0
    except BaseException as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        known = isinstance(
            exc,
            (DemoError, ClusterError, operator_chart.ChartError, envs.MissingEnvironment, AssertionError),
        )
        if isinstance(exc, KeyboardInterrupt):
            print()
            say("interrupted: stopping everything the demo started ...")
        elif known:
            say(f"error: {exc}")
        if down(root) and not isinstance(exc, KeyboardInterrupt):
            say("stopped everything the demo had started")
        if isinstance(exc, KeyboardInterrupt):
            say("stopped; nothing of the demo is left running")
            return 130
        if known:
            return 1
        raise


def raise_on_termination() -> None:
    """SIGTERM and SIGHUP (a closed terminal) clean up as Ctrl-C does."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)


def down(root: Path) -> list[str]:
    """Stop and remove what `up` recorded in `root` (any process may call it); returns what it
    stopped, each said as it goes."""
    state_file = root / "demo.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    stopped = []
    if stop_preview(root):
        say("stopped the preview's operator and control plane")
        stopped.append("the preview")
    if _stop_operator(root):
        say("stopped the operator")
        stopped.append("the operator")
    if state.get("kubeconfig"):
        # Not ours to stop: remove only what the demo put there.
        cluster = ExistingCluster(Path(state["kubeconfig"]))
        out = cluster.kubectl(
            "delete", "namespace", state["namespace"], "--wait=false", "--ignore-not-found", check=False
        )
        if out.returncode == 0 and "deleted" in out.stdout:
            say(f"deleting namespace {state['namespace']} of {state['kubeconfig']}")
            stopped.append(f"namespace {state['namespace']}")
        elif out.returncode != 0:
            say(f"could not delete namespace {state['namespace']}: {out.stderr.strip()}")
    else:
        embedded = LocalCluster(root / "cluster")
        if embedded.state_file.exists():
            if embedded.status()["running"]:
                namespace = state.get("namespace", NAMESPACE)
                if operator_chart.uninstall(embedded, namespace):
                    say(f"helm uninstall {operator_chart.RELEASE} -n {namespace}")
                    stopped.append("the operator's release")
                out = embedded.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
                if out.returncode == 0:
                    say(f"deleting namespace {namespace}")
                    stopped.append(f"namespace {namespace}")
                embedded.kubectl("delete", "pv", MODEL_CLAIM, "--wait=false", check=False)
            embedded.stop()  # the node's pods, containerd, kubelet, the host's bridge and rules; says what it stopped
            stopped.append("the control plane and the real node")
    state_file.unlink(missing_ok=True)
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_dev.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, default=paths.REPO / DEMO_DIR)
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="an existing cluster for the operator part (the pods are not run here)",
    )
    args = parser.parse_args(argv)
    root = args.dir.resolve()
    if args.action == "down":
        say("stopped the demo" if down(root) else f"no demo was running from {root}")
        return 0
    kubeconfig = args.kubeconfig.expanduser().resolve() if args.kubeconfig else None
    if kubeconfig is not None and not kubeconfig.is_file():
        parser.error(f"no kubeconfig at {kubeconfig}")
    return up(root, kubeconfig)


if __name__ == "__main__":
    sys.exit(main())
