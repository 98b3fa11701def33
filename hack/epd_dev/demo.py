"""`make demo`: the operator on a local control plane, then one real multimodal request through
the pod it made.

    python -m epd_dev.demo up [--kubeconfig FILE] [--port-base N]
    python -m epd_dev.demo down

SIMULATED: the control plane (upstream binaries, built once) with four kwok GPU nodes, the
operator, and the seed's two topologies of Qwen2.5-VL-7B: kwok plays the kubelets, nothing runs.

REAL: a tiny LLaVA-style model as the seed's second topology (encoder + prefill + decode behind
vllm-router). The operator makes the unit's pod and kwok schedules it; its containers then run
here on the CPU as the pod spec says, in the kubelet's order (epd_dev.vllm.unit_runner). One
request with two images goes through epd_client (prime -> render -> generate) and is compared
with an aggregated engine's answer (epd_dev.demo_serving).

Everything keeps running for exploration. What outlives `up` is recorded in the demo folder as
it starts (demo.json, operator.pid, serving.json, cluster/), so `down`, Ctrl-C or a failure
stops exactly that. With --kubeconfig an existing cluster replaces the embedded one for the
SIMULATED part, in its own namespace, and the REAL part is skipped: that cluster's pods are its
own kubelets' job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from epd_client import EPDClientError, discover

from . import paths
from .demo_serving import Records, print_explore, say, serve
from .localcluster import ClusterError, LocalCluster, binaries
from .operator_process import OperatorProcess, get_json, install_crd, wait_for
from .vllm import engines, envs, serving, tiny_model
from .vllm.unit_runner import UnitRunner

DEMO_DIR = ".demo"
NAMESPACE = "epd-demo"
SEEDS = ("encoder-regular.yaml", "encoder-prefill-decode.yaml")
# Below Linux's ephemeral range (32768+), so no outgoing connection holds one of them.
PORT_BASE = 28000
# The unit: router, encoder, prefill, decode (then NIXL side-channel ports nothing binds on CPU).
UNIT_PORTS = 4
# The aggregated reference engine's block starts here; its engine listens on base + 1.
REFERENCE_OFFSET = 10
ENVS = ["serve", "router"]
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


def check_ports(ports: list[int], hint: str) -> None:
    """Every port free on 0.0.0.0 (where the rendered engines listen), else who holds it."""
    for port in ports:
        with socket.socket() as sock:
            # As the servers bind: connections of a previous run still in TIME_WAIT do not count.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                raise DemoError(
                    f"port {port} is in use{_listener(port)}. The demo's engines listen on "
                    f"{_ranges(ports)}: stop that process, or {hint}"
                ) from None


def _listener(port: int) -> str:
    """' (pid N: command)' of whoever listens on `port`, from /proc; '' if it cannot be told."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f" (pid {proc.name}: {command.strip()[:100]})"
    return ""


def _ranges(ports: list[int]) -> str:
    spans: list[list[int]] = []
    for port in sorted(ports):
        if spans and port == spans[-1][1] + 1:
            spans[-1][1] = port
        else:
            spans.append([port, port])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


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
    if binaries.missing_binaries():
        wanted["the control plane (make cluster)"] = binaries.cache_dir()
    if runs_engines:
        for name in ENVS:
            if not (envs.env_dir(name) / envs.MARKER).is_file():
                wanted[f"the vLLM venv {name!r}"] = envs.env_dir(name)
        if not (tiny_model.cached_path() / envs.MARKER).is_file():
            wanted["the tiny model"] = tiny_model.cached_path()
    return wanted


def unit_ports(port_base: int) -> list[int]:
    return list(range(port_base, port_base + UNIT_PORTS))


def reference_port(port_base: int) -> int:
    return port_base + REFERENCE_OFFSET + 1


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
    while engines.group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return True


def _ensure_namespace(cluster: Any, namespace: str) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
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


def _wait_reconciled(cluster: Any, namespace: str, operator: OperatorProcess, ready_within: float) -> bool:
    """Every EPDDeployment's status written for its generation; then Ready within `ready_within`
    seconds (False if not: an existing cluster may have no GPU nodes for them)."""

    def reconciled() -> bool:
        items = get_json(cluster, "epd", "-n", namespace)["items"]
        return bool(items) and all(
            i.get("status", {}).get("observedGeneration") == i["metadata"]["generation"] for i in items
        )

    wait_for(reconciled, 120, "the operator to reconcile the EPDDeployments", operator.tail)
    out = cluster.kubectl(
        "wait",
        "--for=condition=Ready",
        "epd",
        "--all",
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
    rows = [("", "DEPLOYMENT", "UNIT", "NODE", "READY", "WHY NOT", "ENCODERS", "ENTRY")]
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


def operator_part(cluster: Any, root: Path, namespace: str, *, embedded: bool) -> OperatorProcess:
    """The CRD, the operator and the seed's two topologies. On the embedded cluster kwok plays
    their kubelets; an existing cluster's nodes run them (or say why they cannot)."""
    label = "SIMULATED" if embedded else "CLUSTER"
    if embedded:
        banner("SIMULATED: the operator and the seed's two topologies on kwok's fake GPU nodes")
    else:
        banner(f"CLUSTER: the operator and the seed's two topologies on {cluster.kubeconfig}")
    say(f"{label}  installing the EPDDeployment CRD")
    install_crd(cluster)
    _ensure_namespace(cluster, namespace)
    # On someone else's cluster, watch only the demo's namespace: an operator installed there
    # owns the others.
    operator = _start_operator(
        cluster.kubeconfig, root, ["--all-namespaces"] if embedded else ["--namespace", namespace]
    )
    _apply_seeds(cluster, namespace, label)
    ready_within = 180 if embedded else 60
    say(f"{label}  waiting for the operator to reconcile both ...")
    ready = _wait_reconciled(cluster, namespace, operator, ready_within)
    if embedded and not ready:
        raise DemoError(
            f"the seed's EPDDeployments did not become Ready within {ready_within}s on kwok's "
            f"nodes; the operator's log says why: {operator.log_path}"
        )
    print()
    print(cluster.kubectl("get", "epd", "-n", namespace, "-o", "wide").stdout)
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
    return operator


# --------------------------------------------------------------------------- up / down


def real_part(
    cluster: LocalCluster, root: Path, namespace: str, port_base: int, reference: engines.Engine, records: Records
) -> None:
    banner("REAL: the operator's pod for a tiny LLaVA model, run here on the CPU with real vLLM")
    answer = serve(cluster, root, namespace, port_base=port_base, reference=reference, records=records)
    print_explore(answer, cluster, namespace, root)


def start_reference(root: Path, port_base: int, records: Records) -> engines.Engine:
    """The aggregated engine the answer is compared with: started before the control plane so
    that it loads meanwhile."""
    manifest = serving.aggregated_manifest(tiny_model.tiny_model_path(), port_base=port_base + REFERENCE_OFFSET)
    runner = UnitRunner.from_manifest(
        serving.in_process_workers(manifest), root / "logs" / "aggregated", uid=str(uuid.uuid4()), die_with_parent=False
    )
    (reference,) = runner.consumers
    reference.start()
    records.engine(reference, "aggregated")
    say(
        f"REAL  starting the aggregated reference engine in the background (pid {reference.proc and reference.proc.pid}, "
        f"port {reference.port}, log {reference.log_path})"
    )
    return reference


def up(root: Path, kubeconfig: Path | None = None, port_base: int = PORT_BASE) -> int:
    began = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    _raise_on_termination()
    if down(root):  # a previous demo: its engines hold the ports
        say("stopped the previous demo")
    (root / "demo.json").write_text(
        json.dumps({"kubeconfig": str(kubeconfig) if kubeconfig else None, "namespace": NAMESPACE})
    )
    try:
        runs_engines = kubeconfig is None
        check_cache_writable(missing_caches(runs_engines))
        if runs_engines:
            check_ports(
                [*unit_ports(port_base), reference_port(port_base)], "pick other ports: make demo DEMO_PORT=29000"
            )
            check_memory(ENGINES)
        if binaries.missing_binaries():
            binaries.build()
        if kubeconfig is not None:
            cluster: Any = ExistingCluster(kubeconfig)
            say(f"using the existing cluster of {kubeconfig} (namespace {NAMESPACE}; the REAL part is skipped)")
            operator_part(cluster, root, NAMESPACE, embedded=False)
            say(
                f"ready in {time.monotonic() - began:.0f}s. Try: kubectl --kubeconfig {kubeconfig} -n {NAMESPACE} "
                "get epd,statefulsets,pods. Stop (and delete the namespace) with: make demo-down"
            )
            return 0
        banner("Installing what serving needs (cached in " + str(paths.cache_root()) + ")")
        envs.install(ENVS)
        say(f"tiny model: {tiny_model.tiny_model_path()}")
        records = Records(root)
        reference = start_reference(root, port_base, records)
        cluster = LocalCluster(root / "cluster", nodes=4).start()
        operator_part(cluster, root, NAMESPACE, embedded=True)
        real_part(cluster, root, NAMESPACE, port_base, reference, records)
        say(f"ready in {time.monotonic() - began:.0f}s; everything keeps running. Stop it all with: make demo-down")
        return 0
    except BaseException as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        known = isinstance(
            exc, (DemoError, ClusterError, engines.EngineFailed, envs.MissingEnvironment, AssertionError)
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


def _raise_on_termination() -> None:
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
    stopped = Records(root).stop_all()
    if stopped:
        say(f"stopped {', '.join(stopped)}")
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
            embedded.stop()  # says what it stopped
            stopped.append("the control plane")
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
    parser.add_argument(
        "--port-base",
        type=int,
        default=PORT_BASE,
        help=f"the unit listens on this port and the next {UNIT_PORTS - 1}, the reference "
        f"on +{REFERENCE_OFFSET + 1} (default {PORT_BASE})",
    )
    args = parser.parse_args(argv)
    root = args.dir.resolve()
    if args.action == "down":
        say("stopped the demo" if down(root) else f"no demo was running from {root}")
        return 0
    kubeconfig = args.kubeconfig.expanduser().resolve() if args.kubeconfig else None
    if kubeconfig is not None and not kubeconfig.is_file():
        parser.error(f"no kubeconfig at {kubeconfig}")
    return up(root, kubeconfig, args.port_base)


if __name__ == "__main__":
    sys.exit(main())
