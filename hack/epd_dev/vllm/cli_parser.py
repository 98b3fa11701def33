"""A long-lived parse_with_vllm.py per vLLM version, in that version's parser venv (importing
vLLM takes ~20 s, so every contract test of a version, and `make vllm-minor`, share one process)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

HELPER = Path(__file__).with_name("parse_with_vllm.py")


class ParserDied(RuntimeError):
    """The helper process exited; the message ends with its stderr."""


class VllmParser:
    """parse_with_vllm.py running in the parser venv of one vLLM version."""

    def __init__(self, version: str, python: Path) -> None:
        self.version = version
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the helper's stderr, kept for its lifetime
        self._proc = subprocess.Popen(
            [str(python), str(HELPER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
        self._actions: list[dict[str, Any]] | None = None
        self._envs: dict[str, list[str]] | None = None

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin and self._proc.stdout
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            self._log.seek(0)
            raise ParserDied(f"the vLLM {self.version} parser process died:\n{self._log.read()[-4000:]}")
        return json.loads(line)

    def actions(self) -> list[dict[str, Any]]:
        """Every argument of `vllm serve`: dest, options, kind, nargs, type, choices."""
        if self._actions is None:
            self._actions = self._ask({"op": "actions"})["actions"]
        return self._actions

    def _env_names(self) -> dict[str, list[str]]:
        if self._envs is None:
            self._envs = self._ask({"op": "envs"})
        return self._envs

    def envs(self) -> set[str]:
        """Every environment variable this vLLM reads (vllm.envs)."""
        return set(self._env_names()["envs"])

    def removed_envs(self) -> set[str]:
        """The environment variables this vLLM names as removed: it refuses to start with one set."""
        return set(self._env_names()["removed"])

    def environ(self, cases: list[tuple[dict[str, str], bool]]) -> list[dict[str, Any]]:
        """Per (environment, hard_fail), what the engine's check of its environment at start makes
        of it: `{"ok": true}` or `{"ok": false, "error"}` (see parse_with_vllm.py)."""
        asked = [{"env": env, "hard_fail": hard_fail} for env, hard_fail in cases]
        results: list[dict[str, Any]] = self._ask({"op": "environ", "cases": asked})["results"]
        return results

    def parse(self, argvs: dict[str, list[str]], *, full: bool = True) -> dict[str, dict[str, Any]]:
        """Parse each argv (`["vllm", "serve", ...]`); see parse_with_vllm.py for the answer."""
        commands = [{"id": key, "argv": argv, "full": full} for key, argv in argvs.items()]
        return self._ask({"op": "parse", "commands": commands})["results"]

    def post_routes(self) -> set[str]:
        """Every path this vLLM's API routers declare for POST."""
        return set(self._ask({"op": "post_routes"})["routes"])

    def media(self, requests: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """Per (route, body) of a primed route, the media items vLLM's own parsing hands its
        multimodal processor, or its refusal (see parse_with_vllm.py)."""
        asked = [{"route": route, "body": body} for route, body in requests]
        results: list[dict[str, Any]] = self._ask({"op": "media", "requests": asked})["results"]
        return results

    def media_urls(self, cases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Per rendered engine ({"argv", "env", "urls"}), what its media loading does with each URL
        (see parse_with_vllm.py)."""
        results: list[list[dict[str, Any]]] = self._ask({"op": "media_urls", "cases": cases})["results"]
        return results

    def ec_connector(self, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        """What the command's EC connector makes of its config as the engine starts (no GPU):
        `{"ok", "checked", "error"}`; see parse_with_vllm.py. From 0.34 on."""
        return self._ask({"op": "ec_connector", "argv": argv, "env": env})

    def openapi(self, paths: list[str]) -> dict[str, Any]:
        """The OpenAPI document of the API routers that declare these POST paths."""
        return self._ask({"op": "openapi", "paths": paths})

    def model_fields(self, model: str) -> set[str]:
        """The fields of vLLM's pydantic model `module:Class`."""
        return set(self._ask({"op": "model_fields", "model": model})["fields"])

    def media_uuids(self, parts: list[dict[str, Any]]) -> list[list[Any]]:
        """Per content part, [media parser method, uuid] as vLLM's chat parser hands it on."""
        calls: list[list[Any]] = self._ask({"op": "media_uuids", "parts": parts})["calls"]
        return calls

    def route_uuids(self, responses: dict[str, Any], anthropic: dict[str, Any]) -> dict[str, list[Any]]:
        """The uuids of the media parts vLLM's chat messages keep from a Responses request and an
        Anthropic Messages request."""
        found: dict[str, list[Any]] = self._ask({"op": "route_uuids", "responses": responses, "anthropic": anthropic})
        return found

    def media_keys(self, items: list[tuple[str, str | None, str]], processor_kwargs: dict[str, Any]) -> list[str]:
        """Each (modality, uuid, content) item's key (mm hash) as vLLM computes it."""
        keys: list[str] = self._ask(
            {"op": "media_keys", "items": [list(i) for i in items], "processor_kwargs": processor_kwargs}
        )["keys"]
        return keys

    def config(self) -> dict[str, Any]:
        """The fields of vLLM's EC/KV transfer config classes, its connectors, and the extra config
        keys each EC connector reads; see parse_with_vllm.py."""
        return self._ask({"op": "config"})

    def close(self) -> None:
        # Nothing to flush: killing skips vLLM's slow interpreter shutdown.
        self._proc.kill()
        self._proc.wait()
        self._log.close()
