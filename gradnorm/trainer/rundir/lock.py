"""The run directory: never lose a run, never let two runs write one directory, remember every resume.

Rules (rank 0 alone writes; every rank takes the same read-only decisions):

- A fresh run (no --resume) refuses a directory that holds a run (config.json, metrics.jsonl or a
  checkpoint) unless --overwrite is given.
- --overwrite deletes nothing up front: the old run's files and checkpoint directories (torn
  ``.ckpt_step*.tmp`` ones included) move to ``previous_run/`` and are deleted only once the new run
  has a complete checkpoint (``checkpoints.latest_checkpoint``: a renamed ``ckpt_step{N}/``, never
  a ``.tmp``), at its end or at the next start. If the new run stops before that, its partial files
  go and the old run moves back; after a crash that left no chance to do so (SIGKILL, perhaps
  mid-save), the next start refuses with the way out.
- ``.lock`` holds the owner's pid and host. A second run on the directory refuses; a lock whose
  pid is dead on this host is stale (a killed run) and is taken over with a warning.
- --resume compares the flags that define the run with config.json (``gradnorm.trainer.rundir.history``);
  config.json keeps the latest values at the top level and every start in ``history``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.guards.outpaths import FINAL, is_export

LOCK = ".lock"


PREVIOUS = "previous_run"


RUN_FILES = ("config.json", "metrics.jsonl", "warmup.json", "learning_curve.png", "tensorboard", "wandb")
"""A run's records; the last two are the directories of --report-to."""


def run_files(out: Path) -> list[Path]:
    """The files of a run in ``out``: its records, its checkpoint directories (old single-file
    ``ckpt_step*.pt`` ones too), torn ``.ckpt_step*.tmp`` directories and its Hugging Face export
    ``final/`` when an export wrote it (not the lock, not previous_run/, not a user's own final/)."""
    records = [out / name for name in RUN_FILES if (out / name).exists()]
    export = [out / FINAL] if is_export(out / FINAL) else []  # else --overwrite left the old policy in the new run
    return sorted(records + export + list(out.glob("ckpt_step*")) + list(out.glob(".ckpt_step*.tmp")))


def has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a complete checkpoint, the one thing that makes a run resumable."""
    return latest_checkpoint(out) is not None


def check(out: Path, resume: bool, overwrite: bool, rank: int = 0) -> None:
    """The read-only decision every rank takes before anything is written; a one-line ValueError.

    On rank 0, the one that takes the lock, another run's live lock comes first: while an
    --overwrite run is in its warm-up, previous_run/ exists and no checkpoint does, which is not a
    stranded replacement but one still running. (Another rank may see its own job's rank 0 holding
    the lock already, so it leaves the lock to rank 0, whose line is printed first.)
    """
    owner = live_owner(out / LOCK) if rank == 0 else None
    if owner is not None:
        raise ValueError(in_use(out, owner))
    stranded = (out / PREVIOUS).is_dir() and not has_checkpoint(out)
    if stranded and not overwrite:
        raise ValueError(f"{out / PREVIOUS} holds the run that an --overwrite replaced, and the replacement "
                         f"stopped before its first checkpoint: move everything in {PREVIOUS}/ back into {out} to keep "
                         "the old run, or give --overwrite again to start over")
    found = run_files(out) if out.is_dir() else []
    if found and not resume and not overwrite:
        names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"--output-dir {out} holds a run ({names}): --resume to continue it, --overwrite to "
                         "replace it, or choose another --output-dir")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class RunDir:
    """Rank 0's handle on the output directory: the lock, and setting an old run aside."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.created: list[Path] = []
        """Directories this process created (removed again if they are still empty at the end)."""
        self.locked = False
        self.fresh = True

    def open(self, resume: bool, overwrite: bool) -> None:
        """Create the directory, take the lock, then settle previous_run/ (raises a one-line ValueError)."""
        missing = [p for p in [self.out, *self.out.parents] if not p.exists()]
        self.out.mkdir(parents=True, exist_ok=True)
        self.created, self.fresh = missing, not resume  # deepest first
        self._lock()
        previous = self.out / PREVIOUS
        if previous.is_dir() and has_checkpoint(self.out):  # its replacement reached a checkpoint
            shutil.rmtree(previous)
        if overwrite:
            if previous.is_dir():  # a replacement stranded without a checkpoint: its partial files go
                self._remove(run_files(self.out))
            elif run_files(self.out):
                previous.mkdir()
                for path in run_files(self.out):
                    path.rename(previous / path.name)
                print(f"warning: --overwrite: the previous run in {self.out} is in {previous}/ until this run's "
                      "first checkpoint exists", file=sys.stderr, flush=True)

    def close(self, succeeded: bool) -> None:
        """Delete previous_run/ once replaced, or move it back; release the lock; remove what stayed empty."""
        if self.locked:  # without the lock the directory may be another run's: touch nothing in it
            try:
                self._settle(succeeded)
            finally:
                (self.out / LOCK).unlink(missing_ok=True)
                self.locked = False
        if not succeeded:
            for path in self.created:  # nothing half-written: a directory we made and left empty goes
                try:
                    path.rmdir()
                except OSError:
                    break

    def _settle(self, succeeded: bool) -> None:
        previous = self.out / PREVIOUS
        if previous.is_dir():
            if has_checkpoint(self.out):
                shutil.rmtree(previous)
            elif not succeeded:
                self._remove(run_files(self.out))
                for path in previous.iterdir():
                    path.rename(self.out / path.name)
                previous.rmdir()
                print(f"warning: this run stopped before its first checkpoint; the previous run is back in "
                      f"{self.out}", file=sys.stderr, flush=True)
        elif not succeeded and self.fresh and not has_checkpoint(self.out) and not _logged(self.out):
            self._remove(run_files(self.out))  # a fresh run that failed before its first step leaves nothing

    def _lock(self) -> None:
        path, me = self.out / LOCK, {"pid": os.getpid(), "host": socket.gethostname(), "started": now()}
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = live_owner(path)
                if owner is None:
                    stale = _read_lock(path)
                    print(f"warning: {path} was left by pid {stale['pid']}, which is no longer running (a killed "
                          "run); taking it over", file=sys.stderr, flush=True)
                    path.unlink(missing_ok=True)
                    continue
                raise ValueError(in_use(self.out, owner)) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.locked = True
            return
        raise ValueError(f"--output-dir {self.out}: could not take the lock {path}; another run took it first")

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for path in paths:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _logged(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def live_owner(path: Path) -> dict | None:
    """The owner recorded in the lock ``path``, unless there is no lock or it is provably stale: its
    pid is dead on this host (a killed run). A lock of another host, or a torn one, is respected."""
    if not path.exists():
        return None
    owner = _read_lock(path)
    stale = owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) and not _pid_alive(owner["pid"])
    return None if stale else owner


def in_use(out: Path, owner: dict) -> str:
    who = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
    return (f"--output-dir {out} is in use by another run ({who}, since {owner.get('started', '?')}); wait for it, "
            f"or delete {out / LOCK} if that run is gone")


def _read_lock(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):  # torn or foreign: not provably stale, so it is respected
        return {}


def now() -> str:
    """The local time, to the second, as the lock and config.json's history record a start."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
