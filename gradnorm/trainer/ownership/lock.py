"""The run directory: never lose a run, never let two runs write one directory, remember every resume.

Rules (rank 0 alone reads output-dir and writes it; the other ranks learn its decision):

- A run is what the trainer marks as one: ``.gradnorm-run``, written before any other file of the
  run (or a checkpoint directory, or the config.json of a run from before the marker). A user's
  own config.json or wandb/ is not a run, and is never moved, replaced or deleted: a start that
  would write over it is refused.
- A fresh run (no --resume) refuses a directory that holds a run unless --overwrite is given.
- --overwrite deletes nothing up front: the old run's files and checkpoint directories (torn
  ``.ckpt_step*.tmp`` ones included) move to ``previous_run/`` and are deleted only once the new run
  has a complete checkpoint (``checkpoints.latest_checkpoint``: a renamed ``ckpt_step{N}/``, never
  a ``.tmp``), at its end or at the next start, with a ``warning:`` line that says so. If the new
  run stops before that, its partial files go and the old run moves back. A move into
  previous_run/ that fails (a read-only checkpoint, a mount point) is undone: what moved moves back
  and ``MoveFailed`` names the file and the cause; the old run stays whole where it was.
- The trainer deletes only what it can prove it wrote: it marks the previous_run/ it makes
  (``.gradnorm-previous`` inside, written before the first rename into it). A previous_run that is
  not so marked (a user's notes or backup, a symlink, a file, or one an older gradnorm left) is
  never moved into, moved out of or deleted; a start that needs the name is refused in one line.
- A stranded --overwrite (``stranded``: the trainer's previous_run/ holds the old run, and a kill
  left the replacement without a checkpoint and no chance to move the old run back): a plain start
  is refused naming both ways out; --resume puts the old run back (journalled, the replacement's
  partial files deleted, a ``warning:`` line) and continues it from its latest checkpoint;
  --overwrite starts the replacement over.
- Moving a run is many renames, so each move is journalled first (``.overwrite-journal.json``,
  written whole by one rename): a kill between two renames leaves the journal, and the next start
  (``settle``, before anything reads the directory) finishes the move back, so the old run is whole
  again, and says so. No start ever sees half a run.
- ``.lock`` is held with ``flock`` for the owner's whole life (the kernel drops it when the process
  dies, however it dies), and holds the owner's pid, host and start for the messages. Taking it is
  one atomic step, so two starts that find a killed run's lock cannot both take it; a lock nobody
  holds is stale (a killed run, or one whose write failed and left it empty) and is taken over with
  a warning. A lock of another host, or one written without flock (an older gradnorm) whose pid is
  alive, is respected. A failed write of the lock removes it.
- --resume compares the flags that define the run with config.json (``gradnorm.trainer.ownership.history``);
  config.json keeps the latest values at the top level and every start in ``history``."""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.guards.outpaths import FINAL, is_export

LOCK = ".lock"


class MoveFailed(Exception):
    """--overwrite could not move the old run into previous_run/; the move is undone (one line)."""


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


def check(out: Path, resume: bool, overwrite: bool) -> None:
    """The read-only decision rank 0 takes before anything is written (after ``settle``); a
    one-line ValueError.

    Another run's live lock comes first: while an --overwrite run is in its warm-up, previous_run/
    exists and no checkpoint does, which is not a stranded replacement but one still running.
    """
    owner = live_owner(out / LOCK)
    if owner is not None:
        raise ValueError(in_use(out, owner))
    previous = out / PREVIOUS
    if stranded(out) and not overwrite and not resume:
        kept = latest_checkpoint(previous)
        resume_does = (f"put the old run back and continue it from its latest checkpoint {kept.name}" if kept else
                       "put the old run back (it has no checkpoint, so nothing trains: it is only restored)")
        raise ValueError(f"{previous}/ holds the run that an --overwrite replaced, and the replacement stopped before "
                         f"its first checkpoint: rerun with --resume to {resume_does}, or with --overwrite to start "
                         "the replacement over (the old run is deleted at its first checkpoint)")
    foreign = foreign_files(out) if not made_previous(out) else []  # previous_run/: a run was here
    if foreign:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in foreign)
        raise ValueError(f"--output-dir {out} holds {names}, which no gradnorm run wrote (there is no {MARKER}); "
                         "the run would write over them: choose another --output-dir, or move them away")
    found = run_records(out) if out.is_dir() else []
    if found and not resume and not overwrite:
        names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"--output-dir {out} holds a run ({names}): --resume to continue it, --overwrite to "
                         "replace it, or choose another --output-dir")
    if overwrite and not made_previous(out) and run_files(out):
        _refuse_foreign_previous(out)


def _refuse_foreign_previous(out: Path) -> None:
    """--overwrite is about to set the old run aside into previous_run/: a previous_run the trainer
    did not make (a file, a symlink, a user's directory) is refused before anything moves."""
    previous = out / PREVIOUS
    if previous.is_symlink():
        what = f"a symlink (to {os.readlink(previous)})"
    elif previous.is_dir():
        what = f"a directory the trainer did not make (no {PREVIOUS_MARKER} in it: yours, or an older gradnorm's)"
    elif previous.exists():
        what = "a file"
    else:
        return
    kept = next(previous.with_name(f"{PREVIOUS}.kept{n or ''}") for n in itertools.count()
                if not os.path.lexists(previous.with_name(f"{PREVIOUS}.kept{n or ''}")))  # mv must not write over one
    raise ValueError(f"--overwrite sets the old run in {out} aside into {previous}, and {previous} is {what}, which "
                     f"the trainer never moves into or deletes: rename it (mv {shlex.quote(str(previous))} "
                     f"{shlex.quote(str(kept))}) and rerun, or choose another --output-dir")


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
        """Whether the run files in output-dir are this run's own (a failed fresh start removes them):
        not while an old run is still in place (an --overwrite before or after a failed set-aside)."""
        self._fd: int | None = None

    def open(self, resume: bool, overwrite: bool) -> None:
        """Create the directory, take the lock, then settle previous_run/: delete it (the replacement
        has a checkpoint), put the old run back (--resume of a stranded --overwrite) or set the old run
        aside into it (--overwrite). A one-line ValueError; ``MoveFailed`` when a move is undone."""
        missing = [p for p in [self.out, *self.out.parents] if not p.exists()]
        self.out.mkdir(parents=True, exist_ok=True)
        self.created = missing  # deepest first
        self.fresh = not resume and not run_files(self.out)
        self._lock()
        previous = self.out / PREVIOUS
        if made_previous(self.out) and has_checkpoint(self.out):  # its replacement reached a checkpoint
            self._drop_previous()
        if resume and stranded(self.out):
            self._put_back()
        elif overwrite:
            if made_previous(self.out):  # a replacement stranded without a checkpoint: its partial files go
                self._remove(run_files(self.out))
            elif run_files(self.out):
                _refuse_foreign_previous(self.out)
                self._set_aside([p.name for p in run_files(self.out)])
                print(f"warning: --overwrite: the previous run in {self.out} is in {previous}/ until this run's "
                      "first checkpoint exists", file=sys.stderr, flush=True)
            self.fresh = True
        if not (self.out / MARKER).is_file():  # before any other file of this run
            (self.out / MARKER).write_text(json.dumps({"by": "gradnorm/train.py", "started": now()}) + "\n")

    def close(self, succeeded: bool) -> None:
        """Delete previous_run/ once replaced, or move it back; release the lock; remove what stayed empty."""
        if self.locked:  # without the lock the directory may be another run's: touch nothing in it
            try:
                self._settle(succeeded)
            finally:
                self._unlock()
        if not succeeded:
            for path in self.created:  # nothing half-written: a directory we made and left empty goes
                try:
                    path.rmdir()
                except OSError:
                    break

    def _settle(self, succeeded: bool) -> None:
        if (self.out / JOURNAL).exists():  # a move that failed half-way: the next start's ``settle`` finishes it
            return
        if made_previous(self.out):
            if has_checkpoint(self.out):
                self._drop_previous()
            elif not succeeded:
                _move_back(self.out, [p.name for p in run_files(self.out)], _moved_names(self.out / PREVIOUS))
                print(f"warning: this run stopped before its first checkpoint; the previous run is back in "
                      f"{self.out}", file=sys.stderr, flush=True)
        elif not succeeded and self.fresh and not has_checkpoint(self.out) and not _logged(self.out):
            self._remove(run_files(self.out))  # a fresh run that failed before its first step leaves nothing

    def _drop_previous(self) -> None:
        previous = self.out / PREVIOUS
        shutil.rmtree(previous)
        print(f"warning: {self.out} holds a checkpoint of the run that replaced the one in {previous}/ "
              f"({latest_checkpoint(self.out).name}), so that old run is deleted now: {previous}/ is gone",
              file=sys.stderr, flush=True)

    def _put_back(self) -> None:
        """--resume of a stranded --overwrite: the replacement's partial files go, the old run comes back."""
        previous = self.out / PREVIOUS
        discard = [p.name for p in run_files(self.out)]
        _move_back(self.out, discard, _moved_names(previous))
        print(f"warning: --resume: {previous}/ held the run that an --overwrite replaced, and the replacement stopped "
              f"before its first checkpoint; the replacement's files ({', '.join(discard) or 'none'}) are deleted and "
              f"the old run is back in {self.out}", file=sys.stderr, flush=True)

    def _set_aside(self, names: list[str]) -> None:
        """Move the old run's ``names`` into a new, marked previous_run/, journalled; a failed move is
        undone (what moved moves back, previous_run/ and the journal go) and raises ``MoveFailed``."""
        previous, moved = self.out / PREVIOUS, []
        try:
            with _journal(self.out, "aside", names):
                previous.mkdir()
                _write_whole(previous / PREVIOUS_MARKER, json.dumps({"by": "gradnorm/train.py", "of": str(self.out),
                                                                     "made": now()}) + "\n")
                for name in names:
                    _rename(self.out / name, previous / name)
                    moved.append(name)
        except OSError as err:
            if err.filename2 is not None:  # a rename: err.filename is what would not move
                what = f"move {err.filename} into {previous}/"
            elif err.filename == str(previous):
                what = f"make {previous}/"
            else:
                what = f"write {err.filename or self.out}"
            why = err.strerror or str(err)
            try:
                _move_back(self.out, [], moved, journalled=False)
                (self.out / JOURNAL).unlink(missing_ok=True)
                (self.out / (JOURNAL + ".tmp")).unlink(missing_ok=True)
            except OSError as again:
                raise MoveFailed(f"--overwrite: could not {what} ({why}), and moving back what had moved failed too "
                                 f"({again.strerror or again}); the next start in {self.out} finishes the move back "
                                 f"(its {JOURNAL} records it)") from err
            raise MoveFailed(f"--overwrite: could not {what} ({why}); nothing is moved or deleted: the old run is "
                             f"whole in {self.out}; make it movable, or choose another --output-dir") from err

    def _lock(self) -> None:
        """Take ``.lock`` in one atomic step: an exclusive flock on the file that the path names when
        the lock is held (checked after locking: another start may have removed and recreated it);
        then write this process's pid, host and start whole, or remove the lock if that fails."""
        path = self.out / LOCK
        deadline = time.monotonic() + 1.0  # a moment, for a probe's shared lock (``live_owner``) to pass
        while True:
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(path, os.O_RDWR), False
                except FileNotFoundError:  # its owner released it just now
                    continue
            held = _flock(fd, fcntl.LOCK_EX)
            if held is True:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                raise ValueError(in_use(self.out, _read_lock(path)))
            if not _names(path, fd):  # another start removed the file we locked: lock the one there now
                os.close(fd)
                continue
            break
        stale = None if created else _read_lock(path)  # a lock that was there: whose, and is it dead?
        if stale is not None:
            if not _stale(stale, held):
                os.close(fd)
                raise ValueError(in_use(self.out, stale))
            print(f"warning: {path} {_left_by(stale)}; taking it over", file=sys.stderr, flush=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": now(), "flock": held is not None}
        try:
            _rewrite(fd, json.dumps(me))
        except OSError as err:  # a full disk: never leave an empty or torn lock behind
            path.unlink(missing_ok=True)
            os.close(fd)
            raise OSError(err.errno, err.strerror, str(path)) from err
        self._fd, self.locked = fd, True

    def _unlock(self) -> None:
        """Remove the lock, then let go of it: a start that opened it meanwhile finds its path gone and retries."""
        try:
            (self.out / LOCK).unlink(missing_ok=True)
        finally:
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self.locked = None, False

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for path in paths:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def settle(out: Path) -> None:
    """Finish a move of a run that a kill interrupted, before anything reads ``out``.

    Rank 0 takes the lock (a live run's lock is respected: that run is still moving it) and moves
    everything back: an interrupted set-aside (the replacement had not started) and an interrupted
    move back (the replacement had stopped before its first checkpoint) both end with the old run
    whole in ``out`` and no previous_run/, which a warning says.
    """
    journal = out / JOURNAL
    try:
        if not journal.is_file():
            return
    except OSError:  # an --output-dir the preflight refuses (a name too long): nothing of a run to settle
        return
    entry = _read_journal(journal)
    run_dir = RunDir(out)
    run_dir._lock()
    try:
        # an interrupted set-aside: the replacement wrote nothing yet, so there is nothing to discard
        _move_back(out, entry["discard"] if entry["move"] == "back" else [], entry["names"], journalled=False)
        journal.unlink()
    finally:
        run_dir._unlock()
    what = "set the old run aside" if entry["move"] == "aside" else "put the old run back"
    print(f"warning: an --overwrite of {out} was interrupted while it {what}; the move is undone and the old run "
          f"is whole in {out} again", file=sys.stderr, flush=True)


def _moved_names(previous: Path) -> list[str]:
    """What the trainer moved into its previous_run/: everything there but its marker."""
    return sorted(name for name in os.listdir(previous) if name != PREVIOUS_MARKER)


def _move_back(out: Path, discard: list[str], names: list[str], journalled: bool = True) -> None:
    """Delete the replacement's files ``discard`` from ``out`` and move the old run's ``names`` back
    from previous_run/, journalled so that ``settle`` can finish it after a kill; previous_run/ goes
    once it holds nothing but its marker. Safe to repeat: a name already back is not deleted again
    (it is the old run's now) and not moved again."""
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
        if previous.is_dir() and not previous.is_symlink() and not _moved_names(previous):
            (previous / PREVIOUS_MARKER).unlink(missing_ok=True)
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
        _write_whole(self.out / JOURNAL, json.dumps(self.entry))  # the journal exists whole or not at all
        _sync_dir(self.out)

    def __exit__(self, kind, err, tb):
        if kind is None:  # an exception leaves the journal for the next start's settle
            _sync_dir(self.out)
            (self.out / JOURNAL).unlink()
        return False


def _write_whole(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or does not exist: written beside it, synced, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


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


def _flock(fd: int, how: int) -> bool | None:
    """Try ``flock(fd, how | LOCK_NB)``: False when this process now has it, True when another
    process holds the lock, None when the file system has no flock (then the pid rule alone decides)."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return False


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        now_there = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now_there.st_dev, now_there.st_ino)


def _rewrite(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    data = text.encode()
    if os.pwrite(fd, data, 0) != len(data):  # a short write is a full disk too
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), LOCK)
    os.fsync(fd)


def _stale(owner: dict, held: bool | None) -> bool:
    """Whether a lock that no process holds by flock (``held`` False; None: no flock here) is a dead
    run's. Empty or torn: its writer failed or died (with flock, for certain). One written under
    flock on this host: its owner is gone, whatever its pid now names. One of another host: that host
    alone can tell, so it is respected. Written without flock (an older gradnorm): its pid decides."""
    if held is None:
        return owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) \
            and not _pid_alive(owner["pid"])
    if not owner:
        return True
    if owner.get("host") != socket.gethostname():
        return False
    return bool(owner.get("flock")) or (isinstance(owner.get("pid"), int) and not _pid_alive(owner["pid"]))


def _left_by(owner: dict) -> str:
    if not owner:
        return "is empty or torn (a start whose write of it failed, e.g. on a full disk) and no process holds it"
    if owner.get("flock"):
        return f"was left by pid {owner.get('pid')}, which no longer holds it (a killed run)"
    return f"was left by pid {owner.get('pid')}, which is no longer running (a killed run)"


def live_owner(path: Path) -> dict | None:
    """The owner recorded in the lock ``path``, unless there is no lock or it is stale: no process
    holds it (``_stale`` says which of those are a dead run's). A held lock is live whatever it says."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:  # unreadable: not provably stale, so it is respected
        return {}
    try:
        held = _flock(fd, fcntl.LOCK_SH)
        owner = _read_lock(path)
    finally:
        os.close(fd)  # a shared lock taken only to look goes with the descriptor
    if held:
        return owner
    return None if _stale(owner, held) else owner


def in_use(out: Path, owner: dict) -> str:
    if "pid" in owner:
        who = f"pid {owner['pid']} on host {owner.get('host', '?')}, since {owner.get('started', '?')}"
    else:  # held, but not written yet
        who = "its lock names no owner yet: a start still writing it"
    return (f"--output-dir {out} is in use by another run ({who}); wait for it, "
            f"or delete {out / LOCK} if that run is gone")


def _read_lock(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):  # torn or foreign: {}
        return {}


def now() -> str:
    """The local time, to the second, as the lock and config.json's history record a start."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
