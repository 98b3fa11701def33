"""The operator image's Dockerfile, checked without Docker.

No image can be built here, so: parse the Dockerfile for what must hold (base image, non-root
user, entrypoint), and run its build stage's RUN step for real on a copy of exactly the files
its COPY instructions would see through .dockerignore, then use the result.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from epd_operator.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    return [
        (parts[0].upper(), parts[1].strip() if len(parts) > 1 else "")
        for parts in (line.strip().split(None, 1) for line in logical)
    ]


def stages(text: str) -> list[list[tuple[str, str]]]:
    """Each stage's instructions, FROM first (the global ARGs before the first FROM left out)."""
    result: list[list[tuple[str, str]]] = []
    for op, args in instructions(text):
        if op == "FROM":
            result.append([])
        if result:
            result[-1].append((op, args))
    return result


def global_args(text: str) -> dict[str, str]:
    """ARG defaults declared before the first FROM (what a FROM line may use)."""
    found = {}
    for op, args in instructions(text):
        if op == "FROM":
            break
        if op == "ARG":
            name, _, default = args.partition("=")
            found[name] = default
    return found


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex (Go filepath.Match plus `**`, as Docker does)."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "$")


def build_context(root: Path) -> list[Path]:
    """Files Docker would send as the build context: .dockerignore applied, last match wins."""
    rules = [
        (line.startswith("!"), _pattern_regex(line.lstrip("!")))
        for line in (raw.strip() for raw in DOCKERIGNORE.read_text().splitlines())
        if line and not line.startswith("#")
    ]
    kept = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        # A pattern matching a parent folder matches everything below it.
        prefixes = ["/".join(rel.split("/")[: n + 1]) for n in range(rel.count("/") + 1)]
        excluded = False
        for negated, regex in rules:
            if any(regex.match(prefix) for prefix in prefixes):
                excluded = not negated
        if not excluded:
            kept.append(path)
    return kept


def test_base_images_and_stages():
    text = DOCKERFILE.read_text()
    parsed = stages(text)
    assert len(parsed) == 2, "a build stage and a runtime stage"
    # One base for both stages (the venv's python is the base's): python:3.11-slim unless the
    # build passes another (`make images` passes its Debian-built one).
    assert [stage[0][1].split()[0] for stage in parsed] == ["${BASE}", "${BASE}"]
    assert global_args(text) == {"BASE": "python:3.11-slim"}


def test_runtime_stage_runs_as_non_root_with_the_operator_entrypoint():
    runtime = stages(DOCKERFILE.read_text())[-1]
    users = [args for op, args in runtime if op == "USER"]
    assert users, "the runtime stage must set USER"
    user, _, group = users[-1].partition(":")
    assert user == "65532" and group in ("", "65532"), "numeric uid, so runAsNonRoot can verify it"
    (entrypoint,) = [args for op, args in runtime if op == "ENTRYPOINT"]
    assert entrypoint == '["epd-operator"]', "exec form, so signals reach the operator (kopf stops cleanly)"
    (cmd,) = [args for op, args in runtime if op == "CMD"]
    build_parser().parse_args(json.loads(cmd))  # the default command is valid


def test_build_context_holds_the_sources_and_nothing_private():
    files = {p.relative_to(ROOT).as_posix() for p in build_context(ROOT)}
    assert "pyproject.toml" in files
    assert "operator/epd_operator/cli.py" in files
    assert any(f.startswith("operator/epd_operator/templates/") for f in files), "render templates are data"
    for forbidden in (".venv/", ".git/", ".cluster", "tests/", "__pycache__", ".egg-info", "hack/"):
        assert not [f for f in files if forbidden in f], forbidden


def test_the_dockerfile_install_step_gives_a_working_operator(tmp_path):
    """Run the build stage (COPY + RUN) on the build context, with paths mapped into tmp."""
    build_stage = stages(DOCKERFILE.read_text())[0]
    context = tmp_path / "context"
    for path in build_context(ROOT):
        target = context / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)

    image_root = tmp_path / "image"
    workdir = "/"
    for op, args in build_stage[1:]:
        if op == "WORKDIR":
            workdir = args
        elif op == "COPY":
            *sources, dest = shlex.split(args)
            dest_path = image_root / (dest if dest.startswith("/") else f"{workdir}/{dest}").lstrip("/")
            for source in sources:
                src = context / source
                assert src.exists(), f"COPY {source}: not in the build context (.dockerignore?)"
                if src.is_dir():  # a folder's contents go into the destination
                    shutil.copytree(src, dest_path, dirs_exist_ok=True)
                elif dest.endswith("/"):  # into a folder, keeping the name
                    dest_path.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dest_path / src.name)
                else:
                    dest_path.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dest_path)
        elif op == "RUN":
            # Absolute paths of the image live under image_root; `python` is this interpreter.
            command = re.sub(r"(?<![\w.])/(opt|src)\b", lambda m: f"{image_root}/{m.group(1)}", args)
            bindir = tmp_path / "bin"
            bindir.mkdir(exist_ok=True)
            (bindir / "python").unlink(missing_ok=True)
            (bindir / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
            env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
            env.pop("VIRTUAL_ENV", None)
            out = subprocess.run(
                ["sh", "-c", command],
                check=False,  # the assert below shows the output
                cwd=image_root / workdir.lstrip("/"),
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert out.returncode == 0, f"RUN {args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"

    venv = image_root / "opt" / "epd-operator"
    help_text = subprocess.run(
        [venv / "bin" / "epd-operator", "run", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--all-namespaces", "--namespace", "--peering", "--standalone", "--liveness", "--metrics-port"):
        assert flag in help_text
    python = str(venv / "bin" / "python")
    # The units' EPD proxy runs from this image too, on its runtime dependencies alone.
    subprocess.run([python, "-c", "import epd_dataplane.server"], capture_output=True, check=True)
    proxy_help = subprocess.run(
        [venv / "bin" / "epd-dataplane", "proxy", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--upstream" in proxy_help and "--encoders-dns" in proxy_help
    # Installed, not linked to the sources (the image drops /src), and without test extras.
    location = subprocess.run(
        [python, "-c", "import epd_operator.cli as m; print(m.__file__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert location.startswith(str(venv)), location
    count_templates = (
        "import importlib.resources as r; print(len(list(r.files('epd_operator').joinpath('templates').iterdir())))"
    )
    templates = subprocess.run([python, "-c", count_templates], capture_output=True, text=True, check=True)
    assert int(templates.stdout) > 0, "the render templates must be installed as package data"
    for test_only in ("pytest", "hypothesis"):
        imported = subprocess.run([python, "-c", f"import {test_only}"], capture_output=True, check=False)
        assert imported.returncode != 0, f"{test_only} is installed: the image must not carry test extras"
