"""The test suite's JupyterLab server: one per session, on 127.0.0.1, a free port, a random token,
fresh config and data directories, terminals off, no news or update checks, and copies of the
notebooks without their outputs (every count and output a test sees comes from its own run).

The ``lab`` fixture (tests/conftest.py) starts it through ``serve``; the browser tests
(tests/notebooks/test_browser.py) drive it, and tests/reliability/test_safety.py checks where it
listens and that it asks for its token. ``notebook_path`` is how a test names a notebook of the
repository: a missing one skips locally and fails in CI.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat

from tests.helpers import ROOT
from tests.helpers.skipping import skip_or_fail

REPO_NOTEBOOKS = ROOT / "notebooks"
SERVER_START_S = 90


def notebook_path(name):
    """``notebooks/<name>``, relative to the server's root; a notebook not in the repository skips (fails in CI)."""
    path = REPO_NOTEBOOKS / name
    if not path.exists():  # in CI (CI=true) a missing notebook fails
        skip_or_fail(f"notebook not present yet: notebooks/{name}")
    return f"notebooks/{name}"


@dataclass
class Lab:
    base_url: str
    token: str
    root: Path

    def api(self, method, path):
        req = urllib.request.Request(f"{self.base_url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def notebook_url(self, relpath, workspace):
        # A workspace per test: no tab or kernel of an earlier test is restored into this one.
        return f"{self.base_url}lab/workspaces/{workspace}/tree/{relpath}?token={self.token}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_env(home):
    env = dict(os.environ)
    for var in ("MPLBACKEND", "JUPYTER_PATH", "JUPYTERLAB_DIR"):  # the kernel must use the inline backend
        env.pop(var, None)
    dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTER_DATA_DIR": "data",
            "JUPYTERLAB_SETTINGS_DIR": "settings", "JUPYTERLAB_WORKSPACES_DIR": "workspaces",
            "IPYTHONDIR": "ipython"}
    for var, name in dirs.items():
        (home / name).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / name)
    # Two cores: keep the kernel's torch and BLAS to one thread (the notebooks also call set_num_threads(1)).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               JUPYTER_PLATFORM_DIRS="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
    # No "would you like news?" toast over the page, and no request for news or updates.
    notification = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True, exist_ok=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    return env


def copy_for_the_reader(src, dst):
    """Copy a notebook without outputs, so that every count and output seen comes from this run."""
    nb = nbformat.read(src, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"})
    nbformat.write(nb, dst)


def serve(tmp_path_factory):
    """Start the server on copies of the notebooks without outputs; yield its ``Lab``; stop it."""
    home = tmp_path_factory.mktemp("jupyter-home")
    root = tmp_path_factory.mktemp("lab-root")
    (root / "notebooks").mkdir()
    for src in REPO_NOTEBOOKS.glob("*.ipynb"):
        copy_for_the_reader(src, root / "notebooks" / src.name)
    if (ROOT / "figures").is_dir():  # the notebooks' markdown shows ../figures/*.png
        shutil.copytree(ROOT / "figures", root / "figures", ignore=shutil.ignore_patterns("*.py"))
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.terminals_enabled=False", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly",
           "--LabApp.expose_app_in_browser=True"]  # lets the test read kernel and cell state
    log_path = home / "jupyterlab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=_isolated_env(home), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        server = Lab(f"http://127.0.0.1:{port}/", token, root)
        try:
            _wait_until_it_answers(server, proc, log_path)
            yield server
        finally:
            _stop(server, proc)


def _wait_until_it_answers(server, proc, log_path):
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            server.api("GET", "api/status")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer in {SERVER_START_S}s:\n"
                                   f"{log_path.read_text()[-3000:]}") from None
            time.sleep(0.25)


def _stop(server, proc):
    """Shut the server down through its API (which stops its kernels), then by signal if need be."""
    if proc.poll() is None:
        try:
            server.api("POST", "api/shutdown")
            proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)  # its own session, started above: the server and what it spawned
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
