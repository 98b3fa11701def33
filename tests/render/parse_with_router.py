"""Parse vllm-router command lines with vllm-router's own launcher (run with its venv's python).

stdin: a JSON map id -> argv (`["vllm-router", ...]`); stdout: id -> `{"ok": true, "args": {...}}`
(the RouterArgs the binary would start with, after its own validation) or `{"ok": false,
"exit_code", "error"}`. This is exactly what `vllm-router` runs before it starts serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys

from vllm_router.launch_router import parse_router_args


def _parse(argv: list[str]) -> dict:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_router_args(argv[1:])
            args._validate_router_args()
        return {"ok": True, "args": dataclasses.asdict(args)}
    except SystemExit as exit_:
        return {"ok": False, "exit_code": exit_.code, "error": stderr.getvalue()}
    except ValueError as error:
        return {"ok": False, "exit_code": None, "error": str(error)}


if __name__ == "__main__":
    json.dump({key: _parse(argv) for key, argv in json.load(sys.stdin).items()}, sys.stdout)
