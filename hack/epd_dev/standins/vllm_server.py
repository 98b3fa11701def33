"""A STAND-IN for vLLM engines, NOT vLLM: a small HTTP server answering the four calls
the client makes, in vLLM's shapes, and recording every request.

It exists for what a real engine cannot be made to do on demand (answer slowly, be
counted, be run by the dozen in a unit test) and for the client benchmark. Tests that
need vLLM's real behaviour belong with the real engines (tests/vllm).

- ``POST /v1/chat/completions``: a chat completion; every image URL in it is added to
  ``ec_store``, as an encoder publishing embeddings through its EC connector would. With
  ``ec_transfer=True`` (an encoder of a ``Pools`` model, ECCPUConnector over NIXL) the answer
  also carries ``ec_transfer_params``: per image, this server's host and port as the peer a
  consumer pulls from, as vLLM's producer announces them.
- ``POST /v1/chat/completions/render``: vLLM's shape, ``{"token_ids": [...], "features":
  {"mm_hashes": {"image": [...]}, "mm_placeholders", "kwargs_data", "mm_metadata"}, ...}``
  (the hash of an image here is the hash of its URL), with the request's
  ``ec_transfer_params`` copied in, as vLLM's render does.
  With ``mm_metadata=False`` render answers ``mm_metadata`` null, as vLLM does for a model
  whose items need nothing besides their embedding (LLaVA-like).
- ``POST /inference/v1/generate``: takes the render response; refuses metadata-only items
  (``kwargs_data`` null) without ``ec_transfer_params``, as vLLM does, and answers 500 for
  an item with neither tensors nor metadata (vLLM takes it for a processor-cache hit it does
  not have: "P0/P1 cache drift"); counts each mm_hash
  announced in ``ec_transfer_params`` as a pull (``ec_pulls``, peers in ``pulled``), else one
  found in ``ec_store`` as a hit, else a miss (real vLLM would encode the image itself,
  silently).
- ``POST /v1/chat/completions`` with ``"stream": true``: Server-Sent Events, chunked, one
  ``chat.completion.chunk`` per token then ``data: [DONE]``. With ``chunk_gate`` (a
  ``threading.Semaphore``) every event after the first waits for a release of the gate, so a test
  can read event i before event i+1 exists: proof that nothing between buffers the stream.
- ``POST /v1/completions`` and ``POST /v1/responses``: a completion and a response object in
  OpenAI's shapes (the image of an ``input_image`` part counts as primed like an ``image_url``).
- ``GET /v1/models``: the one model; ``GET /health``: 200; anything else: 404.
- ``files`` (an ``ec_files.FileStore``) with ``ec_role`` "producer" or "consumer": chat
  completions and responses write or read that store as vLLM's ECExampleConnector does.
- ``response_headers`` are added to every answer (for tests of what a proxy passes back).
- ``tls`` (a server-side SSLContext): serve HTTPS, for tests of the client's TLS verification.

Give the encoders and the consumer of one unit the same ``ec_store`` set to model the
node-local EC directory; give a pool's encoders none of the consumers' stores. For a separate process run
``python -m epd_dev.standins.vllm_server --port 0``: it prints its URL on the first line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .ec_files import FileStore, item_names
from .httpkit import BackgroundServer, Served, chunk_bytes, head_bytes, read_request, response_bytes

STREAM_TOKENS = ("Hello", " from", " the", " stand-in")


def mm_hash(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


@dataclass
class Record:
    path: str
    headers: dict[str, str]  # lower-case names
    body: Any
    connection: int
    started: float  # time.monotonic()
    finished: float | None = None
    status: int | None = None
    aborted: bool = False  # the client went away before the answer
    method: str = "POST"
    sent: list[float] = field(default_factory=list)  # time.monotonic() of each streamed event


class StandinServer(Served):
    """In-process use: ``with StandinServer(delay=0.2) as server: ... server.url``."""

    def __init__(
        self,
        *,
        delay: float = 0.0,
        ec_store: set[str] | None = None,
        port: int = 0,
        ec_transfer: bool = False,
        mm_metadata: bool = True,
        chunk_gate: threading.Semaphore | None = None,
        response_headers: list[tuple[str, str]] | None = None,
        tls: ssl.SSLContext | None = None,
        files: FileStore | None = None,
        ec_role: str | None = None,
    ) -> None:
        self.delay = delay
        # With ``files``: an encoder (ec_role "producer") or a consumer ("consumer") of that EC
        # store, with ECExampleConnector's file semantics (ec_files.py).
        self.files = files
        self.ec_role = ec_role
        self.ec_store = ec_store if ec_store is not None else set()
        self.ec_transfer = ec_transfer
        self.mm_metadata = mm_metadata
        self.chunk_gate = chunk_gate
        self.response_headers = response_headers or []
        self.records: list[Record] = []
        self.open_connections = 0
        self.ec_hits = 0
        self.ec_misses = 0
        self.ec_pulls = 0
        self.pulled: list[tuple[str, str]] = []  # (mm_hash, "host:port" of the peer it came from)
        self.metadata_only = 0  # generate items that came without their tensors
        self._connection_ids = itertools.count()
        self._server = BackgroundServer(self.handle, port=port, tls=tls)

    def requests(self, path: str) -> list[Record]:
        return [r for r in self.records if r.path == path]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = next(self._connection_ids)
        self.open_connections += 1
        try:
            while (request := await read_request(reader)) is not None:
                record = Record(
                    request.target,
                    {k.lower(): v for k, v in request.headers},
                    _json_or_none(request.body),
                    connection,
                    time.monotonic(),
                    method=request.method,
                )
                self.records.append(record)
                if self.delay and await _client_left_during(reader, self.delay):
                    record.aborted = True
                    return
                if _streamed(request.method, request.target, record.body):
                    await self._stream(record, writer)
                else:
                    record.status, payload = self._answer(request.method, request.target, record.body)
                    record.finished = time.monotonic()  # before the client can see the answer (a test reads it then)
                    body = json.dumps(payload).encode()
                    answer = response_bytes(record.status, body, headers=self.response_headers)
                    # The answer to a HEAD is its head alone (RFC 9110 §9.3.2), its Content-Length the GET's.
                    writer.write(answer[: len(answer) - len(body)] if request.method == "HEAD" else answer)
                    await writer.drain()
                if not request.keep_alive:
                    return
        except ConnectionError:
            pass
        finally:
            self.open_connections -= 1
            writer.close()

    async def _stream(self, record: Record, writer: asyncio.StreamWriter) -> None:
        record.status = 200
        if self.files is not None and self.ec_role == "consumer":
            self.files.consume(item_names(record.body))
        self.ec_store.update(mm_hash(u) for u in _image_urls(record.body))
        writer.write(head_bytes(200, "text/event-stream", self.response_headers, length=None))
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        events = [_chunk(completion_id, record.body.get("model"), token) for token in STREAM_TOKENS]
        for i, event in enumerate([*events, "[DONE]"]):
            if i and self.chunk_gate is not None:
                await asyncio.to_thread(self.chunk_gate.acquire, timeout=30)
            record.sent.append(time.monotonic())
            writer.write(chunk_bytes(f"data: {event}\n\n".encode()))
            await writer.drain()
        writer.write(chunk_bytes(b""))
        record.finished = time.monotonic()
        await writer.drain()

    def _answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/health":
            return 200, {}
        if method == "GET" and path.split("?")[0] == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "standin", "object": "model", "owned_by": "vllm"}]}
        if method != "POST":
            return 404, {"error": "not found"}
        if not isinstance(body, dict):
            return 400, {"error": "body must be a JSON object"}
        if path in ("/v1/chat/completions", "/v1/responses") and self.files is not None:
            if self.ec_role == "producer":
                self.files.produce(item_names(body))
            elif self.ec_role == "consumer":
                self.files.consume(item_names(body))
        if path == "/v1/chat/completions":
            self.ec_store.update(mm_hash(u) for u in _image_urls(body))
            answer = _chat_completion(body)
            if self.ec_transfer and _image_urls(body):
                answer["ec_transfer_params"] = self._announce(_image_urls(body))
            return 200, answer
        if path == "/v1/chat/completions/render":
            return 200, _render(body, self.mm_metadata)
        if path == "/inference/v1/generate":
            return self._generate(body)
        if path == "/v1/completions":
            return 200, _completion(body)
        if path == "/v1/responses":
            self.ec_store.update(mm_hash(u) for u in _image_urls(body))
            return 200, _response(body)
        return 404, {"error": "not found"}

    def _announce(self, urls: list[str]) -> dict[str, Any]:
        """What vLLM's ECCPUConnector producer puts in ec_transfer_params: per item, where to
        pull it (its side channel; here this server's own address) and how big it is."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return {
            mm_hash(url): {
                "item_indices": [i],
                "metadata": {},
                "peer_host": host,
                "peer_port": int(port),
                "size_bytes": 4096,
                "shape": [4, 512],
            }
            for i, url in enumerate(urls)
        }

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not isinstance(body.get("token_ids"), list):
            return 400, {"error": "token_ids required (send the render response)"}
        features = body.get("features") or {}
        announced = body.get("ec_transfer_params") or {}
        items = _feature_items(features)
        if any(tensors is None and meta is not None for _h, tensors, meta in items) and not announced:
            return 400, {"error": "metadata-only multimodal items require ec_transfer_params"}
        if any(tensors is None and meta is None for _h, tensors, meta in items):
            return 500, {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
        for h, tensors, _meta in items:
            self.metadata_only += tensors is None
            peer = announced.get(h)
            if isinstance(peer, dict) and peer.get("peer_host"):
                self.ec_pulls += 1
                self.pulled.append((h, f"{peer['peer_host']}:{peer['peer_port']}"))
            elif h in self.ec_store:
                self.ec_hits += 1
            else:
                self.ec_misses += 1
        return 200, {
            "request_id": body.get("request_id"),
            "choices": [{"index": 0, "token_ids": [7, 8, 9], "finish_reason": "length"}],
        }


async def _client_left_during(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Sleep, but notice at once when the client closes the connection (HTTP/1.1 clients
    send nothing more before the answer, so any read completing means EOF)."""
    eof = asyncio.ensure_future(reader.read(1))
    done, _ = await asyncio.wait({eof}, timeout=seconds)
    if not done:
        eof.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await eof  # the reader allows one waiter: the next read must not race this one
    return bool(done)


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _streamed(method: str, path: str, body: Any) -> bool:
    return method == "POST" and path == "/v1/chat/completions" and isinstance(body, dict) and body.get("stream") is True


def _image_urls(body: dict[str, Any]) -> list[str]:
    """The image URL of every image_url part of ``messages`` and input_image part of ``input``."""
    urls = []
    conversation = [*(body.get("messages") or []), *(body["input"] if isinstance(body.get("input"), list) else [])]
    for message in conversation:
        for part in message.get("content") if isinstance(message.get("content"), list) else []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url" and isinstance(part["image_url"].get("url"), str):
                urls.append(part["image_url"]["url"])
            elif part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
                urls.append(part["image_url"])
    return urls


def _chunk(completion_id: str, model: Any, token: str) -> str:
    return json.dumps(
        {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": {"content": token}, "finish_reason": None}],
        }
    )


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }


def _response(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "status": "completed",
        "output": [
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "x", "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 8,
            "output_tokens": 1,
            "total_tokens": 9,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _chat_completion(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }


def _render(body: dict[str, Any], mm_metadata: bool) -> dict[str, Any]:
    hashes = [mm_hash(u) for u in _image_urls(body)]
    rendered = {
        "request_id": f"render-{uuid.uuid4().hex}",
        "model": body.get("model"),
        "token_ids": [1, 2, 3, 4],
        "features": {
            "mm_hashes": {"image": hashes},
            "mm_placeholders": {"image": [{"offset": 1 + i, "length": 1} for i in range(len(hashes))]},
            "kwargs_data": {"image": [f"tensors-{h[:8]}" for h in hashes]},
            "mm_metadata": {"image": [f"metadata-{h[:8]}" for h in hashes]} if mm_metadata else None,
        }
        if hashes
        else None,
        "sampling_params": {"max_tokens": body.get("max_tokens", 16)},
    }
    if body.get("ec_transfer_params"):
        rendered["ec_transfer_params"] = body["ec_transfer_params"]
    return rendered


def _feature_items(features: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(mm_hash, tensors, metadata) of every item of a render response's features."""
    kwargs, metadata = features.get("kwargs_data") or {}, features.get("mm_metadata") or {}
    return [
        (h, (kwargs.get(modality) or [None] * len(hashes))[i], (metadata.get(modality) or [None] * len(hashes))[i])
        for modality, hashes in (features.get("mm_hashes") or {}).items()
        for i, h in enumerate(hashes)
    ]


async def _serve_forever(port: int, delay: float) -> None:
    server = StandinServer(delay=delay)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port)
    print(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}", flush=True)
    await listener.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    cli = parser.parse_args()
    asyncio.run(_serve_forever(cli.port, cli.delay))
