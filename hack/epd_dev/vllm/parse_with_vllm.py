"""Parse `vllm serve` command lines with the real vLLM CLI parser (run with a parser venv's python).

Protocol: one JSON request per stdin line, one JSON answer per stdout line.

- `{"op": "actions"}` -> `{"actions": [{"dest", "options", "kind", "nargs", "type"}, ...]}`: every
  argument of the `vllm serve` parser (hidden spellings included).
- `{"op": "envs"}` -> `{"envs": [...], "removed": [...]}`: every environment variable vllm.envs
  reads, and those it names as removed (refused at start; from 0.34 on).
- `{"op": "environ", "cases": [{"env": {...}, "hard_fail": bool}, ...]}` -> `{"results": [...]}`:
  per case, what the engine's check of its environment at start (the platform's
  `validate_environ`, as EngineArgs calls it with `fail_on_environ_validation`) makes of exactly
  that environment: `{"ok": true}` or `{"ok": false, "error": str}`.
- `{"op": "parse", "commands": [{"id", "argv", "full": bool}, ...]}` -> `{"results": {id: ...}}`:
  argv is the whole command (`["vllm", "serve", ...]`). Each result is `{"ok": true, "namespace":
  {...}}`, plus `"engine": {...}` when `full` (the EngineArgs `vllm serve` builds), or
  `{"ok": false, "exit_code": int | None, "error": str}`.
- `{"op": "post_routes"}` -> `{"routes": [...]}`: every path vLLM's API routers declare for POST
  (read from the source of vllm/entrypoints: importing every router needs optional packages).
- `{"op": "ec_connector", "argv": [...], "env": {...}}` -> `{"ok": bool, "checked": str, "error": str}`:
  what a `vllm serve` command's EC connector makes of its config as the engine starts, without a
  GPU: the command is parsed and its ECTransferConfig built as `vllm serve` does; then
  ECCPUConnector's scheduler side is constructed for real (its /dev/shm region, its NIXL agent,
  the producer's ZMQ side channel, with `env` set), ECMooncakeConnector's config class
  (MooncakeECConfig) reads it, and any other connector's class is loaded. The VllmConfig they get
  holds the real ECTransferConfig and ParallelConfig and a stand-in of the model's config (dtype,
  hidden size, processor cache: the real one needs the model's files). Parser venvs from 0.34 on.
- `{"op": "openapi", "paths": [...]}` -> the OpenAPI document of the vLLM API routers that declare
  those POST paths (each router module imported, as `vllm serve` includes it).
- `{"op": "model_fields", "model": "module:Class"}` -> `{"fields": [...]}`: a pydantic model's fields
  (a response model a route declares no schema for).
- `{"op": "media_uuids", "parts": [...]}` -> `{"calls": [[method, uuid], ...]}`: what vLLM's chat
  content-part parser hands its media parser for each part (a recording one): the media kind's
  method and the part's `uuid`.
- `{"op": "route_uuids", "responses": {...}, "anthropic": {...}}` -> `{"responses": [...], "anthropic":
  [...]}`: the uuid of each media part of the chat messages vLLM makes of each request.
- `{"op": "media_keys", "items": [[modality, uuid, content], ...], "processor_kwargs": {...}}` ->
  `{"keys": [...]}`: each item's cache and EC store key (mm hash) as vLLM's processor inputs
  compute it from the uuid and the content.
- `{"op": "config"}` -> `{"ec_transfer_config": [field, ...], "kv_transfer_config": [...],
  "ec_connectors": {name: [extra config key, ...]}, "kv_connectors": [name, ...]}`: the fields of
  vLLM's transfer config classes, its registered connectors, and the `*_connector_extra_config`
  keys each EC connector's sources read (`make vllm-minor` compares minors with it).
- `{"op": "media", "requests": [{"route", "body"}, ...]}` -> `{"results": [...]}`: per request of a
  primed route (the proxy's route labels), what vLLM hands its multimodal processor once it has
  validated the body and parsed its messages: `{"ok": true, "items": [{"modality", "data",
  "uuid", "factors"}, ...]}` in order (factors: the request's fields vLLM hashes the item with),
  or `{"ok": false, "error": str}` when vLLM refuses the request.
- `{"op": "media_urls", "cases": [{"argv", "env", "urls"}, ...]}` -> `{"results": [[...], ...]}`: per
  rendered engine (its `vllm serve` argv and environment), what its media loading does with each
  URL: `{"data": true}`, `{"fetch": url, "allow_redirects": bool}` (the request it would send),
  or `{"refused": str}`. vLLM's own MediaConnector and HTTPConnection, built from the engine args
  the argv parses to; only the HTTP client is a recorder that sends nothing.

It builds the parser exactly as the `vllm` console script does for `serve` (a top-level
FlexibleArgumentParser with the serve subcommand, so the model is the positional `model_tag`),
then, when `full`, runs the subcommand's validation and `AsyncEngineArgs.from_cli_args`.
Needs VLLM_TARGET_DEVICE=cpu on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any


def _parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(dest="subparser")
    serve = ServeSubcommand()
    serve_parser = serve.subparser_init(subparsers)
    return top, serve, serve_parser


def _actions(serve_parser) -> list[dict]:
    options: dict[int, list[str]] = {}
    for option, action in serve_parser._option_string_actions.items():
        options.setdefault(id(action), []).append(option)
    return [
        {
            "dest": action.dest,
            "options": sorted(options.get(id(action), [])),
            "kind": type(action).__name__,
            "nargs": action.nargs,
            "type": getattr(action.type, "__name__", None),
            "choices": list(action.choices) if action.choices else None,
        }
        for action in serve_parser._actions
    ]


def _engine(args) -> dict:
    from vllm.config import ECTransferConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = AsyncEngineArgs.from_cli_args(args)
    ec, kv = engine.ec_transfer_config, engine.kv_transfer_config
    return {
        "model": engine.model,
        "served_model_name": engine.served_model_name,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "mm_encoder_only": engine.mm_encoder_only,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "enforce_eager": engine.enforce_eager,
        "ec_transfer_config": None
        if ec is None
        else {
            "class": type(ec).__name__,
            "is_ec_transfer_config": isinstance(ec, ECTransferConfig),
            "ec_connector": ec.ec_connector,
            "ec_role": ec.ec_role,
            "ec_buffer_device": ec.ec_buffer_device,
            "ec_connector_module_path": ec.ec_connector_module_path,
            "ec_connector_extra_config": ec.ec_connector_extra_config,
            "is_ec_producer": ec.is_ec_producer,
            "is_ec_consumer": ec.is_ec_consumer,
            "connector_class": _connector_class(ec.ec_connector),
        },
        "kv_transfer_config": None
        if kv is None
        else {
            "class": type(kv).__name__,
            "is_kv_transfer_config": isinstance(kv, KVTransferConfig),
            "kv_connector": kv.kv_connector,
            "kv_role": kv.kv_role,
            "kv_buffer_device": kv.kv_buffer_device,
            "kv_connector_extra_config": kv.kv_connector_extra_config,
        },
    }


@contextlib.contextmanager
def _environment(env: dict):
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _vllm_config(engine, ec):
    """What the EC connectors read of a VllmConfig: the real transfer and parallel configs, and a
    STAND-IN for the model's config (vLLM's needs the model's files): bfloat16, hidden size 2048."""
    import types
    import uuid

    import torch
    from vllm.config import ParallelConfig

    model = types.SimpleNamespace(
        model=engine.model,
        dtype=torch.bfloat16,
        get_inputs_embeds_size=lambda: 2048,
        multimodal_config=types.SimpleNamespace(mm_processor_cache_gb=engine.mm_processor_cache_gb),
    )
    parallel = ParallelConfig(
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        data_parallel_size=engine.data_parallel_size,
    )
    return types.SimpleNamespace(
        ec_transfer_config=ec,
        parallel_config=parallel,
        model_config=model,
        lora_config=object() if engine.enable_lora else None,
        instance_id=f"epd-contract-{uuid.uuid4().hex[:8]}",  # names the /dev/shm region
    )


def _ec_connector(top, serve, command: dict) -> dict:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.engine.arg_utils import AsyncEngineArgs

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = top.parse_args(command["argv"][1:])
            serve.validate(args)
            if args.model_tag is not None:
                args.model = args.model_tag
            engine = AsyncEngineArgs.from_cli_args(args)
    except SystemExit:
        return {"ok": False, "checked": "the command", "error": stderr.getvalue()}
    except Exception as error:  # noqa: BLE001 - any rejection is an answer, not a crash
        return {"ok": False, "checked": "the command", "error": f"{type(error).__name__}: {error}"}
    ec = engine.ec_transfer_config
    if ec is None:
        return {"ok": True, "checked": "no EC config", "error": ""}
    checked = f"{ec.ec_connector}'s class"
    try:
        with _environment(command.get("env", {})):
            if ec.ec_connector == "ECMooncakeConnector":
                from vllm.distributed.ec_transfer.ec_connector.mooncake.config import MooncakeECConfig

                checked = "MooncakeECConfig"
                MooncakeECConfig.from_vllm_config(_vllm_config(engine, ec))
            elif ec.ec_connector == "ECCPUConnector":
                checked = "ECCPUConnector's scheduler side"
                ECConnectorFactory.create_connector(_vllm_config(engine, ec), ECConnectorRole.SCHEDULER).shutdown()
            else:
                ECConnectorFactory.get_connector_class(ec)
    except Exception as error:  # noqa: BLE001
        return {"ok": False, "checked": checked, "error": f"{type(error).__name__}: {error}"}
    return {"ok": True, "checked": checked, "error": ""}


def _connector_class(name: str | None) -> str | None:
    """The class vLLM's EC connector factory loads for `name` (None when it has no such entry)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    loader = ECConnectorFactory._registry.get(name)
    return loader().__name__ if loader else None


def _parse(top, serve, command: dict) -> dict:
    argv = command["argv"]
    if argv[:2] != ["vllm", "serve"]:
        return {"ok": False, "exit_code": None, "error": f"not a `vllm serve` command: {argv[:2]}"}
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = top.parse_args(argv[1:])
            result = {"ok": True, "namespace": {k: v for k, v in vars(args).items() if k != "dispatch_function"}}
            if command.get("full"):
                serve.validate(args)
                # What ServeSubcommand.cmd does first: the positional wins over --model.
                if args.model_tag is not None:
                    args.model = args.model_tag
                result["engine"] = _engine(args)
        return result
    except SystemExit as exit_:
        return {"ok": False, "exit_code": exit_.code, "error": stderr.getvalue()}
    except Exception as error:  # noqa: BLE001 - any rejection is an answer, not a crash
        return {"ok": False, "exit_code": None, "error": f"{type(error).__name__}: {error}"}


_POST_ROUTE = re.compile(r"""(?:\.post|\.add_api_route)\(\s*["'](/[^"']*)["']""")


def _post_routes() -> list[str]:
    import vllm.entrypoints

    root = Path(vllm.entrypoints.__file__).parent
    found = {m.group(1) for path in root.rglob("*.py") for m in _POST_ROUTE.finditer(path.read_text())}
    return sorted(found)


# How connector sources read their extra config: `get_from_extra_config("key", ...)` (or an alias
# of it, `get = config.get_from_extra_config`), `extra_config.get("key")`, `extra_config["key"]`.
_EXTRA_KEY = re.compile(
    r"""(?:get_from_extra_config|extra_config\.get)\(\s*["'](\w+)["']|extra_config\[["'](\w+)["']\]"""
)
_EXTRA_ALIAS = re.compile(r"(\w+)\s*=\s*[\w.]*\.get_from_extra_config\b(?!\()")


def _extra_keys(text: str) -> set[str]:
    keys = {a or b for a, b in _EXTRA_KEY.findall(text)}
    for alias in set(_EXTRA_ALIAS.findall(text)):
        keys |= set(re.findall(rf"\b{alias}\(\s*[\"'](\w+)[\"']", text))
    return keys


_EC_PACKAGE = "vllm.distributed.ec_transfer.ec_connector"


def _ec_connector_sources(cls) -> list[Path]:
    """The connector's module and the ec_connector subpackages it imports from."""
    import inspect

    module = Path(inspect.getfile(cls))
    root = Path(inspect.getfile(sys.modules[_EC_PACKAGE])).parent
    text = module.read_text()
    packages = {module.parent} if module.parent != root else set()
    packages |= {
        root / name for name in re.findall(re.escape(_EC_PACKAGE) + r"\.(\w+)", text) if (root / name).is_dir()
    }
    return sorted({module, *(path for package in packages for path in package.rglob("*.py"))})


def _config() -> dict:
    import dataclasses

    import vllm.distributed.ec_transfer.ec_connector  # noqa: F401 - the package _ec_connector_sources reads
    from vllm.config import ECTransferConfig, KVTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ec_connectors = {}
    for name, loader in sorted(ECConnectorFactory._registry.items()):
        keys = set()
        for path in _ec_connector_sources(loader()):
            keys |= _extra_keys(path.read_text())
        ec_connectors[name] = sorted(keys)
    return {
        "ec_transfer_config": sorted(f.name for f in dataclasses.fields(ECTransferConfig)),
        "kv_transfer_config": sorted(f.name for f in dataclasses.fields(KVTransferConfig)),
        "ec_connectors": ec_connectors,
        "kv_connectors": sorted(KVConnectorFactory._registry),
    }


def _openapi(paths: list[str]) -> dict:
    import importlib

    import vllm.entrypoints
    from fastapi import APIRouter, FastAPI

    root = Path(vllm.entrypoints.__file__).parent
    app = FastAPI()
    for path in sorted(root.rglob("*.py")):
        declared = {m.group(1) for m in _POST_ROUTE.finditer(path.read_text())}
        if not declared & set(paths) or path.name != "api_router.py":
            continue
        module = importlib.import_module("vllm.entrypoints." + ".".join(path.relative_to(root).with_suffix("").parts))
        for value in vars(module).values():
            if isinstance(value, APIRouter):
                app.include_router(value)
    return app.openapi()


def _content_part_parser():
    """vLLM's parser of one chat content part, and the media parser base it hands parts to."""
    import importlib

    for module, function, base in (
        ("vllm.renderers.chat_utils.chat_message", "parse_chat_message_content_part", "content_parser"),  # 0.33 on
        ("vllm.renderers.chat_utils", "_parse_chat_message_content_part", ""),  # 0.32: one module
    ):
        try:
            parse = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError):
            continue
        bases = importlib.import_module("vllm.renderers.chat_utils" + (f".{base}" if base else ""))
        return parse, bases.BaseMultiModalContentParser
    raise RuntimeError("no chat content part parser found in this vLLM")


def _media_uuids(parts: list[dict]) -> list[list]:
    import inspect

    parse, base = _content_part_parser()
    calls: list[list] = []

    def recorder(method: str):
        def record(self, *args, **kwargs):
            calls.append([method, args[1] if len(args) > 1 else kwargs.get("uuid")])

        return record

    methods = {name: recorder(name) for name in base.__abstractmethods__ if name != "model_config"}
    recording = type("Recording", (base,), {**methods, "model_config": property(lambda self: None)})
    options: dict[str, Any] = {"wrap_dicts": False, "interleave_strings": False}
    if "mm_tracker" in inspect.signature(parse).parameters:
        options["mm_tracker"] = None
    for part in parts:
        parse(part, recording(), **options)
    return calls


class _Items(list):
    """The items of one modality as the hasher reads them (vLLM's MultiModalDataItems holds them)."""

    def get_all_items_for_hash(self) -> list:
        return list(self)


def _media_keys(items: list[list], processor_kwargs: dict) -> list[str]:
    from vllm.multimodal.processing.inputs import ProcessorInputs

    keys = []
    for modality, uuid, content in items:
        inputs = ProcessorInputs(
            prompt=[],
            mm_data_items={modality: _Items([content])},
            mm_uuid_items={modality: [uuid]},
            hf_processor_mm_kwargs=processor_kwargs,
        )
        keys.append(inputs.get_mm_hashes(model_id="model", hash_algorithm="blake3")[modality][0])
    return keys


def _chat_parsing():
    """vLLM's message parser, its post-processing and its media parser (0.33 made a package of
    chat_utils and dropped the underscores)."""
    try:
        from vllm.renderers.chat_utils import parse_chat_message_content as parse_message
        from vllm.renderers.chat_utils.chat_message import _postprocess_messages as postprocess
        from vllm.renderers.chat_utils.content_parser import MultiModalContentParser
    except ImportError:
        from vllm.renderers.chat_utils import MultiModalContentParser
        from vllm.renderers.chat_utils import _parse_chat_message_content as parse_message
        from vllm.renderers.chat_utils import _postprocess_messages as postprocess
    return parse_message, postprocess, MultiModalContentParser


def _recorder():
    """A stand-in for vLLM's media loading only: vLLM's own chat parsing calls these hooks with
    every item it would load and hand to its multimodal processor; they record the item instead
    of fetching it. parse_input_audio stays vLLM's (it builds the data URL)."""
    from types import SimpleNamespace

    _, _, content_parser = _chat_parsing()
    items: list[dict] = []

    def record(modality, data, uuid):
        items.append({"modality": modality, "data": data, "uuid": uuid})

    class Parser(content_parser):
        def parse_image(self, image_url, uuid=None):
            record("image", image_url, uuid)

        def parse_image_pil(self, image_pil, uuid=None):
            record("image_pil", None if image_pil is None else repr(image_pil), uuid)

        def parse_image_embeds(self, image_embeds, uuid=None):
            record("image_embeds", image_embeds, uuid)

        def parse_audio(self, audio_url, uuid=None):
            record("audio", audio_url, uuid)

        def parse_audio_embeds(self, audio_embeds, uuid=None):
            record("audio_embeds", audio_embeds, uuid)

        def parse_video(self, video_url, uuid=None):
            record("video", video_url, uuid)
            # vLLM also loads the video's audio track as an audio item then.
            if video_url and (self._mm_processor_kwargs or {}).get("use_audio_in_video", False):
                record("audio", video_url, uuid)

        def parse_video_embeds(self, video_embeds, uuid=None, *audio_embeds):
            record("video_embeds", video_embeds, uuid)

        def parse_prompt_embeds(self, data):
            record("prompt_embeds", data, None)

    tracker = SimpleNamespace(model_config=SimpleNamespace(enable_prompt_embeds=True), items=items)
    tracker.create_parser = lambda mm_processor_kwargs=None: Parser(tracker, mm_processor_kwargs)
    tracker.get_num_items = lambda modality: sum(item["modality"] == modality for item in items)
    return tracker


def _conversations(route: str, body: dict) -> list[tuple[list, Any]]:
    """The conversations vLLM parses for a request of the route, as its serving code builds them,
    each with the request vLLM reads it from."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    def chat(request):
        return [(request.messages, request)]

    if route == "chat_completions":
        return chat(ChatCompletionRequest.model_validate(body))
    if route == "cohere_chat":
        from vllm.entrypoints.cohere.protocol import CohereChatV2Request
        from vllm.entrypoints.cohere.serving import ServingCohere

        return chat(ServingCohere._convert_v2_to_chat_completion(CohereChatV2Request.model_validate(body)))
    if route == "messages":
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        return chat(AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest(**body)))
    if route == "chat_completions_batch":
        from vllm.entrypoints.openai.chat_completion.protocol import BatchChatCompletionRequest

        batch = BatchChatCompletionRequest.model_validate(body)
        return [c for messages in batch.messages for c in chat(batch.to_chat_completion_request(messages))]
    if route == "invocations":
        import pydantic
        from vllm.entrypoints.generate.factories import get_generate_invocation_types

        for request_type, _ in get_generate_invocation_types(("generate",)):
            try:
                request = pydantic.TypeAdapter(request_type).validate_python(body)
            except pydantic.ValidationError:
                continue
            return chat(request) if isinstance(request, ChatCompletionRequest) else []
        raise ValueError("no invocation type validates the body")
    if route == "responses":
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.openai.responses.utils import construct_input_messages

        request = ResponsesRequest.model_validate(body)
        messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
        return [(messages, request)]
    raise ValueError(f"unknown route {route!r}")


def _media(request: dict) -> dict:
    parse_message, postprocess, _ = _chat_parsing()
    try:
        items = []
        for messages, parsed in _conversations(request["route"], request["body"]):
            recorder = _recorder()
            conversation = []
            for message in messages:
                conversation += parse_message(
                    message,
                    recorder,
                    "openai",
                    interleave_strings=False,
                    mm_processor_kwargs=parsed.mm_processor_kwargs,
                )
            postprocess(conversation)
            # What vLLM hashes each item with besides the item (vllm/multimodal/processing/inputs.py).
            factors = {"mm_processor_kwargs": parsed.mm_processor_kwargs, "media_io_kwargs": parsed.media_io_kwargs}
            items += [{**item, "factors": {k: v for k, v in factors.items() if v}} for item in recorder.items]
        return {"ok": True, "items": items}
    except Exception as error:  # noqa: BLE001 - vLLM refusing the request is an answer
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}


def _media_urls(top, serve, case: dict) -> list[dict]:
    import asyncio

    from vllm.connections import HTTPConnection
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.multimodal.media.base import MediaIO
    from vllm.multimodal.media.connector import MediaConnector

    class Sent(Exception):
        pass

    class Client:
        """aiohttp's ClientSession.get, as far as vLLM calls it: records the request instead."""

        def get(self, url, *, allow_redirects=True, **_):
            raise Sent(json.dumps({"fetch": str(url), "allow_redirects": allow_redirects}))

    class Connection(HTTPConnection):
        async def get_async_client(self):
            return Client()

    class Loaded(MediaIO):
        def load_bytes(self, data):
            return "bytes"

        def load_base64(self, media_type, data):
            return "data"

        def load_file(self, filepath):
            return "file"

    args = top.parse_args(case["argv"][1:])
    if args.model_tag is not None:
        args.model = args.model_tag
    engine = AsyncEngineArgs.from_cli_args(args)
    saved = dict(os.environ)
    os.environ.update(case["env"])
    try:
        connector = MediaConnector(
            connection=Connection(),
            allowed_local_media_path=engine.allowed_local_media_path,
            allowed_media_domains=engine.allowed_media_domains,
        )
        results = []
        for url in case["urls"]:
            try:
                loaded = asyncio.run(connector.load_from_url_async(url, Loaded()))
                results.append({"data": loaded == "data"} if loaded == "data" else {"loaded": loaded})
            except Sent as sent:
                results.append(json.loads(str(sent)))
            except Exception as error:  # noqa: BLE001 - a refusal is an answer
                results.append({"refused": f"{type(error).__name__}: {error}"})
        return results
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _environ(case: dict) -> dict:
    from vllm.platforms.interface import Platform

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(case["env"])
    try:
        # The base class's: no platform overrides it (0.32 to 0.34), and the parser venv has no GPU.
        Platform.validate_environ(case["hard_fail"])
        return {"ok": True}
    except ValueError as error:
        return {"ok": False, "error": str(error)}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _route_uuids(request: dict) -> dict:
    """The uuids of the media parts of the chat messages vLLM makes of a Responses request's
    ``input`` and of an Anthropic Messages request (each the order of its parts)."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    def uuids(messages) -> list:
        return [
            part.get("uuid")
            for message in messages
            if isinstance(message, dict) and isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") in ("image_url", "input_image")
        ]

    responses = ResponsesRequest(**request["responses"])
    chat = AnthropicServingMessages.to_chat_completion_request(AnthropicMessagesRequest(**request["anthropic"]))
    return {
        "responses": uuids(construct_input_messages(request_instructions=None, request_input=responses.input)),
        "anthropic": uuids(chat.messages),
    }


def main() -> None:
    # vLLM logs to stdout: keep the protocol on a private copy of it, send everything else to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    top, serve, serve_parser = _parser()
    for line in sys.stdin:
        request = json.loads(line)
        answer: dict[str, Any]
        if request["op"] == "actions":
            answer = {"actions": _actions(serve_parser)}
        elif request["op"] == "envs":
            import vllm.envs

            removed = getattr(vllm.envs, "removed_environment_variables", {})
            answer = {"envs": sorted(vllm.envs.environment_variables), "removed": sorted(removed)}
        elif request["op"] == "environ":
            answer = {"results": [_environ(case) for case in request["cases"]]}
        elif request["op"] == "post_routes":
            answer = {"routes": _post_routes()}
        elif request["op"] == "config":
            answer = _config()
        elif request["op"] == "ec_connector":
            answer = _ec_connector(top, serve, request)
        elif request["op"] == "openapi":
            answer = _openapi(request["paths"])
        elif request["op"] == "model_fields":
            import importlib

            module, name = request["model"].split(":")
            answer = {"fields": sorted(getattr(importlib.import_module(module), name).model_fields)}
        elif request["op"] == "media_uuids":
            answer = {"calls": _media_uuids(request["parts"])}
        elif request["op"] == "route_uuids":
            answer = _route_uuids(request)
        elif request["op"] == "media_keys":
            answer = {"keys": _media_keys(request["items"], request.get("processor_kwargs", {}))}
        elif request["op"] == "media_urls":
            answer = {"results": [_media_urls(top, serve, c) for c in request["cases"]]}
        elif request["op"] == "media":
            answer = {"results": [_media(r) for r in request["requests"]]}
        else:
            answer = {"results": {c["id"]: _parse(top, serve, c) for c in request["commands"]}}
        out.write(json.dumps(answer, default=repr) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
