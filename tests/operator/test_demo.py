"""`make demo` (hack/epd_dev/demo.py); its REAL part runs on the real node in tests/node/test_demo.py.

- `up --kubeconfig` against the session's control plane started as an "existing" cluster: the
  operator and the seeds there, nothing run here; `down` leaves that cluster running; Ctrl-C in
  the middle stops what was started.
- The checks made before anything starts: too little memory, a cache folder this user cannot
  write.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from epd_dev import demo
from epd_dev.localcluster import LocalCluster
from epd_dev.operator_process import OperatorProcess, get_json, group_members, wait_for
from epd_dev.paths import REPO
from tests.controlplane.fixtures import require_binaries

DEMO = [sys.executable, "-m", "epd_dev.demo"]


def run_demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DEMO, *args], check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO)


# --------------------------------------------------------------------------- an existing cluster


@pytest.fixture
def existing_cluster(cluster, tmp_path):
    """The session's control plane as a cluster the demo did not start, with no other operator
    watching the demo's namespace while the test runs; whatever the test leaves, `demo down` in
    `tmp_path` removes."""
    running = OperatorProcess.running(cluster.kubeconfig)
    for operator in running:
        operator.stop()
    try:
        yield cluster
    finally:
        run_demo("down", "--dir", str(tmp_path))
        wait_for(
            lambda: cluster.kubectl("get", "namespace", demo.NAMESPACE, check=False).returncode != 0,
            120,
            f"namespace {demo.NAMESPACE} to be deleted",
        )
        for operator in running:
            operator.start()


def operator_pid(root: Path) -> int:
    return int((root / "operator.pid").read_text())


def alive(pid: int) -> bool:
    return bool(group_members(pid))


@pytest.mark.cluster
def test_on_an_existing_cluster_the_demo_runs_the_operator_there_and_no_pod_here(existing_cluster, tmp_path):
    cluster = existing_cluster
    up = run_demo("up", "--dir", str(tmp_path), "--kubeconfig", str(cluster.kubeconfig))
    assert up.returncode == 0, up.stdout + up.stderr
    assert "CLUSTER  both Ready" in up.stdout and "REAL  " not in up.stdout
    items = get_json(cluster, "epd", "-n", demo.NAMESPACE)["items"]
    assert sorted(i["metadata"]["name"] for i in items) == ["qwen-vl-pd", "qwen-vl-regular"]
    assert all(i["status"]["phase"] == "Ready" for i in items)
    pid = operator_pid(tmp_path)
    assert alive(pid) and f"--namespace {demo.NAMESPACE}" in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    assert not (tmp_path / "serving.json").exists() and not (tmp_path / "cluster").exists()

    down = run_demo("down", "--dir", str(tmp_path))

    assert down.returncode == 0, down.stderr
    assert not alive(pid)
    assert cluster.status()["running"], "the existing cluster is not the demo's to stop"
    phase = get_json(cluster, "namespace", demo.NAMESPACE)
    assert phase is None or phase["status"]["phase"] == "Terminating"


@pytest.mark.cluster
def test_ctrl_c_in_the_middle_stops_what_the_demo_started(existing_cluster, tmp_path):
    # Nodes cordoned: the demo's deployments cannot become Ready, so it is still waiting for them
    # when interrupted (on a quiet machine the whole existing-cluster run takes two seconds).
    nodes = [f"node/{n}" for n in existing_cluster.node_names]
    existing_cluster.kubectl("cordon", *nodes)
    try:
        # A shell's background jobs inherit SIGINT ignored (and Python then installs no handler):
        # give the demo the disposition a terminal's Ctrl-C meets.
        proc = subprocess.Popen(
            [*DEMO, "up", "--dir", str(tmp_path), "--kubeconfig", str(existing_cluster.kubeconfig)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            # The demo must see Ctrl-C, which a background test process ignores; signal() takes no lock.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
        )
        wait_for(lambda: (tmp_path / "operator.pid").exists() or proc.poll() is not None, 120, "the operator's start")
        pid = operator_pid(tmp_path)
        assert alive(pid)

        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        existing_cluster.kubectl("uncordon", *nodes)

    assert proc.returncode == 130, out
    assert "interrupted: stopping everything the demo started" in out
    assert "nothing of the demo is left running" in out
    assert not alive(pid)
    assert not (tmp_path / "operator.pid").exists() and not (tmp_path / "demo.json").exists()


# --------------------------------------------------------------------------- checks before anything starts


def test_too_little_memory_says_how_much_the_engines_need(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    4194304 kB\n")
    with pytest.raises(
        demo.DemoError, match=r"4 vLLM engines need about 9 GiB \(2.25 GiB each\), 4.0 GiB is available"
    ):
        demo.check_memory(4, meminfo)
    meminfo.write_text("MemAvailable:   16777216 kB\n")
    demo.check_memory(4, meminfo)  # 16 GiB: enough


@pytest.fixture
def open_tmp():
    """A folder every user can reach (pytest's tmp_path is private to this user)."""
    folder = Path(tempfile.mkdtemp(prefix="epd-demo-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_a_cache_folder_this_user_cannot_write_stops_the_demo_before_anything_starts(open_tmp):
    """`up` with an empty cache in a folder the user cannot write: a message naming the folder
    and the fix, exit 1, and nothing started. Run as another user when the tests run as root
    (root may write anywhere)."""
    cache, root = open_tmp / "cache", open_tmp / "demo"
    cache.mkdir()
    root.mkdir()
    cache.chmod(0o755)
    root.chmod(0o777)  # the demo's own folder stays writable
    code, out = _as_another_user(lambda: demo.main(["up", "--dir", str(root)]), {"EPD_CACHE": str(cache)}, cache)
    assert code == 1, out
    assert re.search(
        rf"must be installed into {re.escape(str(cache))}/\S+, but {re.escape(str(cache))} is not a "
        "folder you can write",
        out,
    ), out
    assert "point the cache elsewhere: make demo EPD_CACHE=" in out
    assert not (root / "serving.json").exists() and not (root / "operator.pid").exists()
    assert list(cache.iterdir()) == []


def _as_another_user(call, env: dict[str, str], cache: Path) -> tuple[int, str]:
    """`call()`'s return code and output, run with `env` by a user who cannot write `cache`: a
    forked child that drops to nobody when this is root, else this user with `cache` read-only."""
    if os.getuid() != 0:
        cache.chmod(0o555)
    with _searchable_by_others(REPO):
        return _in_child(call, env)


@contextlib.contextmanager
def _searchable_by_others(path: Path) -> Iterator[None]:
    """The other user must read the repository (the demo hashes hack/go for a cache key): a
    clone inside a private folder (mktemp -d makes 0700) gets o+x on that folder meanwhile."""
    changed = []
    for folder in [path, *path.parents]:
        mode = stat.S_IMODE(folder.stat().st_mode)
        if os.getuid() == 0 and not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH)
            changed.append((folder, mode))
    try:
        yield
    finally:
        for folder, mode in changed:
            folder.chmod(mode)


def _in_child(call, env: dict[str, str]) -> tuple[int, str]:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        output = io.StringIO()
        code = 99
        try:
            if os.getuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            os.environ.update(env)
            with redirect_stdout(output):
                code = call()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            output.write(f"\n{type(exc).__name__}: {exc}")
        finally:
            os.write(write, json.dumps([code, output.getvalue()]).encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        code, out = json.loads(pipe.read())
    os.waitpid(child, 0)
    return code, out


# --------------------------------------------------------------------------- the first run's builds


def test_builds_side_by_side_stop_the_others_when_one_fails(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    commands = {
        "the sleeper": ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"],
        "the failing one": ["sh", "-c", f"while [ ! -s {pid_file} ]; do sleep 0.05; done; exit 3"],
    }
    with (
        pytest.raises(demo.DemoError, match=r"building the failing one failed \(exit 3\)"),
        demo.SideBySide(commands) as builds,
    ):
        builds.wait()
    assert not Path(f"/proc/{pid_file.read_text().strip()}").exists()  # stopped and reaped


@pytest.mark.cluster
def test_the_preview_shows_the_simulated_part_on_a_cluster_of_its_own_and_stops(tmp_path, capsys):
    """What a fresh machine's `make demo` shows while vLLM's image builds: the operator (a process
    here) and the seeds Ready on a kwok-only control plane, which stops when the builds are done."""
    require_binaries(real_nodes=0)
    try:
        demo.preview(tmp_path)
        out = capsys.readouterr().out
        assert "SIMULATED  both Ready" in out and "this preview stops then" in out
        preview = LocalCluster(tmp_path / demo.PREVIEW_DIR)
        assert preview.status()["running"] and preview.real_nodes == 0
        items = get_json(preview, "epd", "-n", demo.NAMESPACE)["items"]
        assert sorted(i["metadata"]["name"] for i in items) == ["qwen-vl-pd", "qwen-vl-regular"]
        pid = operator_pid(tmp_path)
        assert alive(pid)
    finally:
        assert demo.stop_preview(tmp_path)
    assert not alive(pid) and not preview.status()["running"]
    assert not demo.stop_preview(tmp_path)  # nothing left to stop
