"""A node of the cluster, as one machine can play it for a pod's processes (Linux, as root).

A `Node` has its own loopback address (127.0.0.x: the IP of the pod on it, reachable from the
tests without setup) and runs each of the pod's processes in new mount, UTS, IPC and PID
namespaces: /dev/shm is the pod's own folder (a bind mount, so the pod's containers share it as
they share an emptyDir, and no other pod sees it), the hostname is the node's, and SysV IPC and
process ids are private. So between two nodes only sockets carry data, as between real nodes:
NIXL's UCX backend, which prefers shared memory (posix, sysv, cma) for peers it finds on the
same machine, falls back to TCP (docs/testing.md, "Across nodes").

The network namespace is the host's: loopback aliases need no setup, and the engines and the
tests reach each other without veth pairs or routes.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Run by `unshare` in the new namespaces: name the node, give the pod its /dev/shm, exec argv.
_ENTER = 'hostname "$0" && mount --bind "$1" /dev/shm && shift 1 && exec "$@"'


class NodeUnavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, or no util-linux `unshare`)."""


@dataclass(frozen=True)
class Node:
    name: str  # the hostname its processes see (a kwok node's name)
    address: str  # 127.0.0.x: the pod IP here
    shm_dir: Path  # the pod's /dev/shm; made on `prepare`, removed on `clean`

    def __post_init__(self) -> None:
        if not self.address.startswith("127.") or self.address == "127.0.0.1":
            raise ValueError(f"node {self.name}: {self.address} is not a loopback alias of its own")

    def prepare(self) -> None:
        """An empty /dev/shm, as a new pod's emptyDir."""
        if self.shm_dir.exists():
            raise RuntimeError(f"node {self.name}: {self.shm_dir} exists already: not this pod's")
        self.shm_dir.mkdir(parents=True)

    def clean(self) -> None:
        # What the engines leave in /dev/shm goes with the pod, as an emptyDir does.
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run on this node. `--kill-child`: a SIGTERM to the returned process reaches
        argv (PID 1 of its namespace) as the kubelet's would, and nothing outlives it."""
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--uts",
            "--ipc",
            "--pid",
            "--mount-proc",
            "--kill-child=SIGTERM",
            "sh",
            "-c",
            _ENTER,
            self.name,
            str(self.shm_dir),
            *argv,
        ]


def check_available() -> None:
    """Raise NodeUnavailable, saying why, unless namespaces can be made here."""
    if shutil.which("unshare") is None:
        raise NodeUnavailable("util-linux `unshare` is not installed (apt-get install util-linux)")
    with tempfile.TemporaryDirectory() as shm:
        probe = subprocess.run(
            Node("probe", "127.0.0.2", Path(shm)).wrap(["true"]), check=False, capture_output=True, text=True
        )
    if probe.returncode != 0:
        raise NodeUnavailable(f"cannot make a node's namespaces here (run as root): {probe.stderr.strip()}")
