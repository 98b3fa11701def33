"""The repository's layout rules, checked: what ships, module state, private names."""

from __future__ import annotations

import ast
import re
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
    assert packages == {"epd_operator", "epd_dataplane", "epd_client"}
    assert "epd_operator/templates/engine.yaml.j2" in files, "templates are package data"
    for forbidden in ("test", "epd_dev", "localcluster", "standin", "bench", "conftest"):
        assert not [f for f in files if forbidden in f], forbidden


# Calls that change a container in place.
MUTATORS = frozenset(
    {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard", "clear"}
)


def module_state(tree: ast.Module) -> list[tuple[int, str]]:
    """Module-level names that a function rebinds (`global`) or changes in place (item
    assignment or deletion, augmented assignment, a mutating method): state kept in the module
    rather than in an object passed in. Changes made at import time (configuration) are not."""
    names = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    found = []
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)]
    for function in functions:
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found += [(node.lineno, f"global {name}") for name in node.names]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
                if isinstance(node.value, ast.Name) and node.value.id in names:
                    found.append((node.lineno, f"{node.value.id}[...] changed"))
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id in names:
                found.append((node.lineno, f"{node.target.id} changed"))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in names
            ):
                found.append((node.lineno, f"{node.func.value.id}.{node.func.attr}()"))
    return found


def test_module_state_is_found_by_the_check() -> None:
    tree = ast.parse(
        "SEEN = {}\nCOUNT = 0\nITEMS = []\n"
        "def f(key):\n    global COUNT\n    SEEN[key] = 1\n    ITEMS.append(key)\n"
        "def g():\n    local = {}\n    local['x'] = 1\n    return SEEN.get('x')\n"
    )
    assert [what for _, what in module_state(tree)] == ["global COUNT", "SEEN[...] changed", "ITEMS.append()"]


def test_the_product_keeps_no_state_in_module_globals() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in _modules("operator")
        for line, what in module_state(ast.parse(path.read_text()))
    ]
    assert offenders == []


# Our own packages. (Another project's private names are its business: the vLLM probes run in
# the parser venvs call vLLM's own parsing code, underscores and all, to check against it.)
OWN_PACKAGES = ("epd_operator", "epd_client", "epd_dev", "tests")


def test_no_module_imports_a_private_name_of_another() -> None:
    offenders = []
    for path in _modules(*PYTHON_TREES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 0 and (node.module or "").split(".")[0] not in OWN_PACKAGES:
                    continue
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


def test_make_help_lists_every_target() -> None:
    """Each target carries a `## target: text` comment, and `make help` prints them all."""
    makefiles = [REPO / "Makefile", *sorted((REPO / "hack" / "mk").glob("*.mk"))]
    targets, documented = set(), set()
    for makefile in makefiles:
        for line in makefile.read_text().splitlines():
            if match := re.match(r"^([a-z][a-z0-9-]*):(?!=)", line):
                targets.add(match[1])
            elif match := re.match(r"^## ([a-z][a-z0-9-]*): \S", line):
                documented.add(match[1])
    assert targets - documented == set()
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = {line.split()[1] for line in shown.splitlines() if line.strip().startswith("make ")}
    assert listed == targets
