"""Faults the tests inject: a failing checkpoint publish, a malicious pickle, a dead process's pid, and
the two halves of killing a torchrun worker at a marker its run writes (find the worker, wait for the marker)."""

import errno
import os
import subprocess
import time
from pathlib import Path

from gradnorm.trainer.checkpoint import store


def fail_in_publish(monkeypatch, step: int) -> None:
    """Rank 0 cannot write trainer_state.json into ``.ckpt_step{step}.tmp`` (a permission error)."""
    honest = store._write_synced

    def denied(path, text):
        if f"ckpt_step{step}." in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        honest(path, text)

    monkeypatch.setattr(store, "_write_synced", denied)


class Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # reaped: no process has it now (pids are not reused this fast)


def rank_1_worker(psutil, agent_pid: int, not_pid: int | None = None):
    """The live gradnorm/train.py worker with RANK=1 under the torchrun agent ``agent_pid``, other
    than ``not_pid`` (the one before a restart); None while there is none."""
    for proc in psutil.Process(agent_pid).children(recursive=True):
        try:
            if "gradnorm/train.py" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == "1" \
                    and proc.pid != not_pid:
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


def wait_for_file(path: Path, job: subprocess.Popen, deadline: float, poll_s: float = 0.001) -> None:
    """Return once ``path`` exists; fail if ``job`` ends or ``deadline`` (time.monotonic) passes first."""
    while not path.exists():
        assert job.poll() is None and time.monotonic() < deadline, f"the run ended before {path.name} appeared"
        time.sleep(poll_s)


def fill(directory: Path) -> None:
    """Fill ``directory``'s filesystem to the last byte."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
