"""The session's table of shared launches: a run that several tests read is launched once.

A torchrun launch of the tiny trainer costs about 4 s of CPU per worker (torch, gradnorm and DCP
imported by each) for well under a second of training, so the uninterrupted twin that one test
resumes against and another restarts against is launched once per session, here, and every test
that needs it reads the same directory:

    def test_resume_matches(tmp_path, launched):
        twin = launched("twin-w2-24")  # launched on first use, two at a time; later calls wait or return at once

``launched.start(name, ...)`` begins launches in the background (two at a time) without waiting,
so that a test can start its own job beside the twin it will compare against. A shared run is
read-only: a test that resumes or edits it works on a copy. The session checks that: at its end,
every shared directory must still hold the files it held when its launch ended.

``LAUNCHES`` is the table. Each entry is a ``Launch``: the flags after ``base`` (``TINY`` unless
given) and the number of ranks (torchrun with ``nproc`` ranks; 0 is ``python gradnorm/train.py``
in a subprocess). An entry says which tests read it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT
from tests.helpers.runfiles import every_file
from tests.helpers.trainer import TINY, torchrun_cmd


@dataclass(frozen=True)
class Launch:
    """One run of gradnorm/train.py: ``base`` + ``flags`` on ``nproc`` ranks (0: a plain process)."""

    flags: tuple[str, ...]
    nproc: int = 2
    base: tuple[str, ...] = TINY
    readers: str = ""  # the tests that read it, for the reader of this table

    def command(self, out: Path) -> list[str]:
        if self.nproc == 0:
            return [sys.executable, "gradnorm/train.py", *self.base, "--output-dir", str(out), *self.flags]
        return torchrun_cmd(out, *self.flags, nproc=self.nproc, base=self.base)


# 24 steps on 2 ranks with a checkpoint every 4 and a 10 s collective timeout: the uninterrupted
# twin of both kills of rank 1. --save-every and --timeout-s change no step of the run: the kill
# tests compare every metrics line, so a run whose cadence perturbed training would fail them.
KILLED = ("--steps", "24", "--save-every", "4", "--timeout-s", "10")

LAUNCHES: dict[str, Launch] = {
    "twin-w2-24": Launch(KILLED, readers=(
        "reliability/test_reliability.py::test_sigkill_of_one_rank_ends_the_job_and_resume_matches_an_uninterrupted_run, "
        "reliability/test_auto_resume.py::test_an_elastic_restart_after_a_sigkill_continues_the_run_by_itself")),
}


def run_to_success(cmd: list[str], timeout: float = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr[-4000:]}"


class Launched:
    """The session's shared runs: ``launched(name)`` is the output directory of ``LAUNCHES[name]``."""

    def __init__(self, directory: Path, table: dict[str, Launch] = LAUNCHES, at_once: int = 2):
        self.directory, self.table = directory, table
        self.pool = ThreadPoolExecutor(at_once, thread_name_prefix="launch")
        self.futures: dict[str, Future] = {}
        self.files: dict[str, dict[str, bytes]] = {}  # each run's files when its launch ended
        self.lock = threading.Lock()

    def start(self, *names: str) -> None:
        """Begin the launches of ``names`` not begun yet, in the background."""
        with self.lock:
            for name in names:
                if name not in self.table:
                    raise KeyError(f"{name!r} is not in tests/helpers/launches.py's LAUNCHES: {sorted(self.table)}")
                if name not in self.futures:
                    self.futures[name] = self.pool.submit(self._launch, name)

    def __call__(self, name: str) -> Path:
        """The output directory of ``name``, launched (once) if it was not; read-only to the caller."""
        self.start(name)
        return self.futures[name].result()

    def _launch(self, name: str) -> Path:
        out = self.directory / name
        run_to_success(self.table[name].command(out))
        self.files[name] = every_file(out)
        return out

    def close(self) -> list[str]:
        """Wait for every launch; the names of the shared runs some test changed (should be none)."""
        self.pool.shutdown(wait=True)
        return [name for name, files in self.files.items() if every_file(self.directory / name) != files]
