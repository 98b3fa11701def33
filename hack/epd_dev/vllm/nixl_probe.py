"""Move a registered CPU region from one node to another with NIXL, as ECCPUConnector does.

Run in the serving venv (it has nixl and torch), each side on its own node (nodes.py):

    <serving python> nixl_probe.py serve ADDRESS PORT   # the producer's side
    <serving python> nixl_probe.py read ADDRESS PORT    # the consumer's side

`serve` registers a region holding a known pattern and hands its NIXL agent metadata and
descriptors to one reader over TCP at ADDRESS:PORT (ECCPUConnector's control channel is ZMQ at
the encoder's side-channel address; a plain socket is enough here). `read` fetches them, READs
the region into its own with NIXL (notifying the producer, as the connector does) and checks
the bytes. Each side prints one JSON line; the exit code is 0 when its part succeeded.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

SIZE = 1 << 20
TIMEOUT_S = 60.0
NOTIFICATION = b"read-done"


def _pattern():
    import torch

    return (torch.arange(SIZE, dtype=torch.int64) % 251).to(torch.uint8)


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _send_frames(conn: socket.socket, *frames: bytes) -> None:
    for frame in frames:
        conn.sendall(struct.pack(">Q", len(frame)) + frame)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("peer closed the control channel")
        data += chunk
    return data


def _recv_frame(conn: socket.socket) -> bytes:
    (size,) = struct.unpack(">Q", _recv_exact(conn, 8))
    return _recv_exact(conn, size)


def serve(address: str, port: int) -> dict:
    region = _pattern()
    agent = _agent("producer")
    registered = agent.register_memory(agent.get_reg_descs(region))
    descs = agent.get_serialized_descs(agent.get_xfer_descs(region))
    with socket.create_server((address, port)) as server:
        server.settimeout(TIMEOUT_S)
        conn, peer = server.accept()
        with conn:
            _send_frames(conn, agent.get_agent_metadata(), descs)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        notifs = agent.get_new_notifs()
        if notifs:
            agent.deregister_memory(registered)
            return {"side": "serve", "peer": peer[0], "notifications": {
                name: [m.decode() for m in msgs] for name, msgs in notifs.items()}}
        time.sleep(0.01)
    raise TimeoutError(f"no NIXL notification from the reader within {TIMEOUT_S:.0f}s")


def read(address: str, port: int) -> dict:
    import torch

    region = torch.zeros(SIZE, dtype=torch.uint8)
    agent = _agent("consumer")
    registered = agent.register_memory(agent.get_reg_descs(region))
    deadline = time.monotonic() + TIMEOUT_S
    while True:  # the producer may not listen yet
        try:
            conn = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with conn:
        metadata, descs = _recv_frame(conn), _recv_frame(conn)
    peer = agent.add_remote_agent(metadata)
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(region),
                                   agent.deserialize_descs(descs), peer, NOTIFICATION)
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        time.sleep(0.01)
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    agent.remove_remote_agent(peer)
    agent.deregister_memory(registered)
    return {"side": "read", "state": state, "bytes_equal": bool(torch.equal(region, _pattern()))}


def main(argv: list[str]) -> int:
    side, address, port = argv[0], argv[1], int(argv[2])
    result = serve(address, port) if side == "serve" else read(address, port)
    print(json.dumps(result), flush=True)
    ok = result.get("notifications") if side == "serve" else (
        result["state"] == "DONE" and result["bytes_equal"])
    return 0 if ok else 1


if __name__ == "__main__":
    # nixl-cu13 1.5.1 crashes (SIGSEGV) tearing its agent down at interpreter exit, after the
    # work is done and reported: leave without the teardown, so the exit code is the probe's.
    os._exit(main(sys.argv[1:]))
