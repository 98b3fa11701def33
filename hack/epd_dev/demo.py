"""`make demo`: the operator reconciling the seed's two topologies on the local control plane.

    python -m epd_dev.demo up | down

Pods are simulated by kwok: the scheduler binds them to fake GPU nodes and kwok reports their
containers running and ready. No vLLM process runs (there are no GPUs here); `make test` runs
real vLLM engines on the CPU separately.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from .localcluster import LocalCluster, build
from .operator_process import OperatorProcess, install_crd
from .paths import REPO

DEMO_DIR = Path(".demo")
EXAMPLES = ("encoder-regular.yaml", "encoder-prefill-decode.yaml")


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _start_operator(cluster: LocalCluster, root: Path) -> OperatorProcess:
    operator = OperatorProcess(cluster.kubeconfig, root).start()
    assert operator.proc is not None
    (root / "operator.pid").write_text(str(operator.proc.pid))
    return operator


def _stop_operator(root: Path) -> None:
    pid_file = root / "operator.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    with contextlib.suppress(OSError):
        if b"epd_operator.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():  # never a recycled pid
            os.killpg(pid, signal.SIGTERM)
            _say(f"stopped the operator (pid {pid})")
    pid_file.unlink()


def _print_units(cluster: LocalCluster) -> None:
    items = json.loads(cluster.kubectl("get", "epd", "-A", "-o", "json").stdout)["items"]
    rows = [("DEPLOYMENT", "MODEL", "UNIT", "NODE", "READY", "ENCODERS", "ENTRY (router or consumer)")]
    for item in items:
        for model in item.get("status", {}).get("models", []):
            for unit in model["units"]:
                entry = unit.get("routerUrl") or ", ".join(unit.get("consumerUrls", []))
                rows.append((item["metadata"]["name"], model["name"], unit["pod"], unit.get("node", "-"),
                             str(unit["ready"]), ", ".join(unit.get("encoderUrls", [])), entry))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def up(root: Path) -> None:
    began = time.monotonic()
    build.build()
    root.mkdir(exist_ok=True)
    _stop_operator(root)
    cluster = LocalCluster(root / "cluster", nodes=4).start()
    _say("installing the EPDDeployment CRD")
    install_crd(cluster)
    operator = _start_operator(cluster, root)
    _say(f"operator running (pid {operator.proc.pid}, log {operator.log_path})")
    for example in EXAMPLES:
        _say(f"kubectl apply -f docs/examples/{example}")
        cluster.kubectl("apply", "-f", str(REPO / "docs" / "examples" / example))
    _say("waiting for both EPDDeployments to become Ready ...")
    cluster.kubectl("wait", "--for=condition=Ready", "epd", "--all", "--timeout=180s", timeout=190)
    print()
    print(cluster.kubectl("get", "epd", "-o", "wide").stdout)
    print(cluster.kubectl("get", "pods", "-o", "wide").stdout)
    _print_units(cluster)
    print()
    _say("NOTE: pods are SIMULATED by kwok on fake nodes with nvidia.com/gpu: 8 (no GPUs here); "
         "no vLLM process runs. `make test` runs real vLLM engines on the CPU.")
    _say(f"ready in {time.monotonic() - began:.0f}s. Try:  export KUBECONFIG={cluster.kubeconfig}; "
         f"export PATH={cluster.dir / 'bin'}:$PATH; kubectl describe epd qwen-vl-pd")
    _say("stop everything with: make demo-down")


def down(root: Path) -> None:
    _stop_operator(root)
    LocalCluster(root / "cluster").stop()
    _say("demo stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_dev.demo", description=__doc__)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, default=REPO / DEMO_DIR)
    args = parser.parse_args(argv)
    (up if args.action == "up" else down)(args.dir.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
