"""A long-lived parse_with_vllm.py per vLLM version (importing vLLM takes ~20 s, so every
contract test of a version shares one process)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

HELPER = Path(__file__).with_name("parse_with_vllm.py")


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

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin and self._proc.stdout
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            self._log.seek(0)
            pytest.fail(f"the vLLM {self.version} parser process died:\n{self._log.read()[-4000:]}")
        return json.loads(line)

    def actions(self) -> list[dict[str, Any]]:
        """Every argument of `vllm serve`: dest, options, kind, nargs, type, choices."""
        if self._actions is None:
            self._actions = self._ask({"op": "actions"})["actions"]
        return self._actions

    def envs(self) -> set[str]:
        """Every environment variable this vLLM reads (vllm.envs)."""
        return set(self._ask({"op": "envs"})["envs"])

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

    def close(self) -> None:
        # Nothing to flush: killing skips vLLM's slow interpreter shutdown.
        self._proc.kill()
        self._proc.wait()
        self._log.close()
