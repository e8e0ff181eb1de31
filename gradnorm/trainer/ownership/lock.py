"""The run directory: never lose a run, never let two runs write one directory, remember every resume.

Rules (rank 0 alone writes; every rank takes the same read-only decisions):

- A run is what the trainer marks as one: ``.gradnorm-run``, written before any other file of the
  run (or a checkpoint directory, or the config.json of a run from before the marker). A user's
  own config.json or wandb/ is not a run, and is never moved, replaced or deleted: a start that
  would write over it is refused.
- A fresh run (no --resume) refuses a directory that holds a run unless --overwrite is given.
- --overwrite deletes nothing up front: the old run's files and checkpoint directories (torn
  ``.ckpt_step*.tmp`` ones included) move to ``previous_run/`` and are deleted only once the new run
  has a complete checkpoint (``checkpoints.latest_checkpoint``: a renamed ``ckpt_step{N}/``, never
  a ``.tmp``), at its end or at the next start. If the new run stops before that, its partial files
  go and the old run moves back; after a crash that left no chance to do so (SIGKILL, perhaps
  mid-save), the next start refuses with the way out.
- Moving a run is many renames, so each move is journalled first (``.overwrite-journal.json``,
  written whole by one rename): a kill between two renames leaves the journal, and the next start
  (``settle``, before any rank reads the directory) finishes the move back, so the old run is whole
  again, and says so. No start ever sees half a run.
- ``.lock`` holds the owner's pid and host. A second run on the directory refuses; a lock whose
  pid is dead on this host is stale (a killed run) and is taken over with a warning.
- --resume compares the flags that define the run with config.json (``gradnorm.trainer.ownership.history``);
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


MARKER = ".gradnorm-run"
"""The file that makes a directory a run: the trainer writes it before any other file of the run."""


JOURNAL = ".overwrite-journal.json"
"""A move of a run between output-dir and previous_run/ in progress (see ``settle``)."""


RUN_FILES = ("config.json", "metrics.jsonl", "warmup.json", "learning_curve.png", "tensorboard", "wandb")
"""A run's records; the last two are the directories of --report-to."""


def is_run(out: Path) -> bool:
    """Whether ``out`` holds a run: the marker, a checkpoint directory (torn ones too), or the
    config.json of a run started before the marker existed (a JSON object with a ``history`` list)."""
    if (out / MARKER).is_file() or _checkpoints(out):
        return True
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("history"), list)


def _checkpoints(out: Path) -> list[Path]:
    return list(out.glob("ckpt_step*")) + list(out.glob(".ckpt_step*.tmp"))


def run_files(out: Path) -> list[Path]:
    """The files of a run in ``out``: its marker and records, its checkpoint directories (old
    single-file ``ckpt_step*.pt`` ones too), torn ``.ckpt_step*.tmp`` directories and its Hugging
    Face export ``final/`` when an export wrote it (not the lock, not previous_run/, not a user's own
    final/); [] when ``out`` holds no run (``is_run``), whatever files it holds."""
    if not is_run(out):
        return []
    records = [out / name for name in (MARKER, *RUN_FILES) if (out / name).exists()]
    export = [out / FINAL] if is_export(out / FINAL) else []  # else --overwrite left the old policy in the new run
    return sorted(records + export + _checkpoints(out))


def run_records(out: Path) -> list[Path]:
    """``run_files`` without the marker: what a run has written. A marker alone is a start in progress
    (rank 0 writes it before the other ranks look) or one that wrote nothing else, so nothing to keep."""
    return [p for p in run_files(out) if p.name != MARKER]


def foreign_files(out: Path) -> list[Path]:
    """Files in ``out`` with the names a run writes (config.json, wandb/, ...) that no run wrote."""
    return [] if not out.is_dir() or is_run(out) else [out / n for n in RUN_FILES if (out / n).exists()]


PREVIOUS_MARKER = ".gradnorm-previous"
"""The file inside previous_run/ that says the trainer made it: written before the first rename
into it. A previous_run/ without it (a user's notes or backup, a symlink) is never moved into, out
of, or deleted."""


def made_previous(out: Path) -> bool:
    """Whether ``out/previous_run`` is a directory the trainer made (not a symlink, its marker inside)."""
    previous = out / PREVIOUS
    return previous.is_dir() and not previous.is_symlink() and (previous / PREVIOUS_MARKER).is_file()


def stranded(out: Path) -> bool:
    """Whether ``out`` holds a stranded --overwrite: the trainer's previous_run/ holds the run an
    --overwrite replaced, and the replacement stopped before its first complete checkpoint (killed
    with no chance to move the old run back). The ways out: --resume puts the old run back and
    continues it, --overwrite starts the replacement over."""
    return made_previous(out) and not has_checkpoint(out)


def has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a complete checkpoint, the one thing that makes a run resumable."""
    return latest_checkpoint(out) is not None


def check(out: Path, resume: bool, overwrite: bool, rank: int = 0) -> None:
    """The read-only decision every rank takes before anything is written (after ``settle``); a
    one-line ValueError.

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
    foreign = foreign_files(out) if not (out / PREVIOUS).is_dir() else []  # previous_run/: a run was here
    if foreign:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in foreign)
        raise ValueError(f"--output-dir {out} holds {names}, which no gradnorm run wrote (there is no {MARKER}); "
                         "the run would write over them: choose another --output-dir, or move them away")
    found = run_records(out) if out.is_dir() else []
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
                names = [p.name for p in run_files(self.out)]
                with _journal(self.out, "aside", names):
                    previous.mkdir()
                    for name in names:
                        _rename(self.out / name, previous / name)
                print(f"warning: --overwrite: the previous run in {self.out} is in {previous}/ until this run's "
                      "first checkpoint exists", file=sys.stderr, flush=True)
        if not (self.out / MARKER).is_file():  # before any other file of this run
            (self.out / MARKER).write_text(json.dumps({"by": "gradnorm/train.py", "started": now()}) + "\n")

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
                _move_back(self.out, [p.name for p in run_files(self.out)], sorted(os.listdir(previous)))
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


def settle(out: Path, rank: int = 0, wait_s: float = 60.0) -> None:
    """Finish a move of a run that a kill interrupted, before any rank reads ``out``.

    Rank 0 takes the lock (a live run's lock is respected: that run is still moving it) and moves
    everything back: an interrupted set-aside (the replacement had not started) and an interrupted
    move back (the replacement had stopped before its first checkpoint) both end with the old run
    whole in ``out`` and no previous_run/, which a warning says. Every other rank waits until the
    journal is gone, so no rank takes a decision from half a run.
    """
    journal = out / JOURNAL
    try:
        if not journal.is_file():
            return
    except OSError:  # an --output-dir the preflight refuses (a name too long): nothing of a run to settle
        return
    if rank != 0:
        deadline = time.monotonic() + wait_s
        while journal.is_file():
            if time.monotonic() > deadline:
                raise ValueError(f"--output-dir {out}: {JOURNAL} (an interrupted move of a run) is still there "
                                 f"after {wait_s:.0f} s; rank 0 finishes it on its start, so look at rank 0's error")
            time.sleep(0.05)
        return
    entry = _read_journal(journal)
    run_dir = RunDir(out)
    run_dir._lock()
    try:
        # an interrupted set-aside: the replacement wrote nothing yet, so there is nothing to discard
        _move_back(out, entry["discard"] if entry["move"] == "back" else [], entry["names"], journalled=False)
        journal.unlink()
    finally:
        (out / LOCK).unlink(missing_ok=True)
        run_dir.locked = False
    what = "set the old run aside" if entry["move"] == "aside" else "put the old run back"
    print(f"warning: an --overwrite of {out} was interrupted while it {what}; the move is undone and the old run "
          f"is whole in {out} again", file=sys.stderr, flush=True)


def _move_back(out: Path, discard: list[str], names: list[str], journalled: bool = True) -> None:
    """Delete the replacement's files ``discard`` from ``out`` and move the old run's ``names`` back
    from previous_run/, journalled so that ``settle`` can finish it after a kill. Safe to repeat: a
    name already back is not deleted again (it is the old run's now) and not moved again."""
    previous = out / PREVIOUS

    def move():
        for name in discard:
            if name in names and not (previous / name).exists():
                continue  # moved back already: out/name is the old run's
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        for name in names:
            if (previous / name).exists() or (previous / name).is_symlink():
                _rename(previous / name, out / name)
        if previous.is_dir() and not any(previous.iterdir()):
            previous.rmdir()

    if journalled:
        with _journal(out, "back", names, discard):
            move()
    else:
        move()


class _journal:
    """``with _journal(out, move, names, discard):`` the moves inside are finished by ``settle`` if killed."""

    def __init__(self, out: Path, move: str, names: list[str], discard: list[str] = ()):
        self.out, self.entry = out, {"move": move, "names": list(names), "discard": list(discard)}

    def __enter__(self):
        tmp = self.out / (JOURNAL + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.entry, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out / JOURNAL)  # the journal exists whole or not at all
        _sync_dir(self.out)

    def __exit__(self, kind, err, tb):
        if kind is None:  # an exception leaves the journal for the next start's settle
            _sync_dir(self.out)
            (self.out / JOURNAL).unlink()
        return False


def _rename(src: Path, dst: Path) -> None:
    """One rename of a run's move (a test interrupts the move here)."""
    os.rename(src, dst)


def _sync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_journal(path: Path) -> dict:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        entry = None
    names = entry.get("names") if isinstance(entry, dict) else None
    discard = entry.get("discard", []) if isinstance(entry, dict) else None
    whole = (isinstance(entry, dict) and entry.get("move") in ("aside", "back")
             and isinstance(names, list) and isinstance(discard, list)
             and all(isinstance(n, str) and n not in ("", ".", "..") and "/" not in n for n in [*names, *discard]))
    if not whole:  # explicit checks, not asserts: python -O must not accept a torn journal
        raise ValueError(f"{path} is unreadable: it records a move of a run between {path.parent} and "
                         f"{path.parent / PREVIOUS}/ that a kill interrupted; finish it by hand (every name in "
                         f"{PREVIOUS}/ back into {path.parent}), then delete it")
    return {**entry, "discard": discard}


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
