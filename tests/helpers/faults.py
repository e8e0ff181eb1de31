"""Faults the tests inject: a failing checkpoint publish, a malicious pickle, a dead process's pid."""

import errno
import os
import subprocess

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
