"""A client of the endpoint picker's ext_proc stream, as a gateway drives it: the messages Envoy
sends for one request (FULL_DUPLEX_STREAMED bodies), and what came back, read plainly."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import json_format, struct_pb2


def headers(method: str = "POST", path: str = "/v1/chat/completions", end: bool = False, **more: str) -> Any:
    given = {":method": method, ":path": path, ":authority": "gateway", ":scheme": "http", **more}
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in given.items()]
            ),
            end_of_stream=end,
        )
    )


def body(data: bytes, end: bool = True) -> Any:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=data, end_of_stream=end))


def with_metadata(message: Any, metadata: dict[str, dict[str, Any]]) -> Any:
    for namespace, values in metadata.items():
        struct = struct_pb2.Struct()
        struct.update(values)
        message.metadata_context.filter_metadata[namespace].CopyFrom(struct)
    return message


@dataclass
class Answer:
    """What the picker answered one request."""

    messages: list[Any] = field(default_factory=list)

    def _headers(self) -> Any:
        return next(m.request_headers for m in self.messages if m.HasField("request_headers"))

    @property
    def set_headers(self) -> dict[str, str]:
        mutation = self._headers().response.header_mutation
        return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}

    @property
    def destination(self) -> list[str]:
        return self.set_headers["x-gateway-destination-endpoint"].split(",")

    @property
    def metadata(self) -> dict[str, Any]:
        found = next(m for m in self.messages if m.HasField("request_headers"))
        return json_format.MessageToDict(found.dynamic_metadata)

    @property
    def clears_route_cache(self) -> bool:
        return self._headers().response.clear_route_cache

    @property
    def body_chunks(self) -> list[tuple[bytes, bool]]:
        return [
            (
                m.request_body.response.body_mutation.streamed_response.body,
                m.request_body.response.body_mutation.streamed_response.end_of_stream,
            )
            for m in self.messages
            if m.HasField("request_body")
        ]

    @property
    def body(self) -> bytes:
        return b"".join(chunk for chunk, _ in self.body_chunks)

    @property
    def immediate(self) -> tuple[int, dict[str, Any]] | None:
        found = next((m.immediate_response for m in self.messages if m.HasField("immediate_response")), None)
        return None if found is None else (found.status.code, json.loads(found.body))


async def exchange(channel: grpc.aio.Channel, messages: list[Any], expect: int) -> Answer:
    """Send ``messages`` on one stream and read ``expect`` answers (all of them as they come)."""
    call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
    answer = Answer()
    for message in messages:
        await call.write(message)
    for _ in range(expect):
        answer.messages.append(await call.read())
    await call.done_writing()
    return answer


def chat_body(*parts: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps(
        {"model": "served", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}], **extra}
    ).encode()
