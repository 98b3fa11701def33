"""The repository's layout rules, checked: what ships, module state, private names."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

from epd_dev.paths import REPO

PYTHON_TREES = ("operator", "hack", "tests")


def _modules(*trees: str) -> list[Path]:
    return sorted(p for tree in trees for p in (REPO / tree).rglob("*.py") if ".venv" not in p.parts)


def test_the_wheel_ships_only_the_product(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("epd_operator-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/", 1)[0] for name in files if not name.split("/", 1)[0].endswith(".dist-info")}
    assert packages == {"epd_operator", "epd_client"}
    assert "epd_operator/templates/engine.yaml.j2" in files, "templates are package data"
    for forbidden in ("test", "epd_dev", "localcluster", "standin", "bench", "conftest"):
        assert not [f for f in files if forbidden in f], forbidden


def test_the_product_keeps_no_state_in_module_globals() -> None:
    offenders = []
    for path in _modules("operator"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: global {', '.join(node.names)}")
    assert offenders == []


def test_no_module_imports_a_private_name_of_another() -> None:
    offenders = []
    for path in _modules(*PYTHON_TREES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {private}")
            elif isinstance(node, ast.Import):
                private = [
                    a.name
                    for a in node.names
                    if any(p.startswith("_") and not p.startswith("__") for p in a.name.split("."))
                ]
                if private:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: import {private}")
    assert offenders == []


def test_nothing_refers_to_files_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    offenders = [
        name
        for name in tracked.split()
        if (REPO / name).is_file()
        and not name.startswith("tests/layout/")
        and any(word in (REPO / name).read_text(errors="replace") for word in ("../shared", "facts.md"))
    ]
    assert offenders == []
