"""Where gradnorm may write or replace a directory: it replaces only what it wrote itself.

An export replaces its target directory whole (``gradnorm.export.write_pretrained``: written to a
temporary sibling, then renamed over it). Replacing means deleting first, so the one question is
which directories that may ever be. The answer is a marker: every directory an export creates holds
``.gradnorm-export``, written before anything else, and only a directory that holds it may be
deleted. Everything else is refused with a one-line ValueError naming the path and why, before
anything is written (the trainer asks in its preflight, so a bad ``--export-hf`` costs no training):

- an empty path (an unset shell variable: ``Path('')`` is ``.``), ``.``, the current directory or
  any parent of it;
- a run directory (``metrics.jsonl``, ``ckpt_step*/``; the trainer's --output-dir and the
  export's RUN_DIR even before they hold anything) or anything inside one,
  except the run's own ``final/``, where ``--export-hf auto`` writes and a re-export replaces; and
  the reverse, a target that contains the run;
- anything inside an earlier export (the next re-export of that one would delete it);
- a file, a path under a file, a symlink that does not resolve to a directory;
- an existing directory that is not empty and holds no marker (someone else's files, a download,
  an export written before the marker existed), and a marked one that now holds subdirectories
  (an export is flat: anything nested was put there by someone else).

A symlink to a directory is followed: the directory it points at is checked and written, the link
is kept. A new directory, an empty one and an earlier export are allowed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MARKER = ".gradnorm-export"
"""The file in every directory an export creates; its presence is the licence to replace it."""
FINAL = "final"
"""The one directory inside a run an export may write: ``--export-hf auto`` (``output-dir/final``)."""
RUN_SIGNS = ("metrics.jsonl", "ckpt_step*", ".ckpt_step*.tmp")
"""What only a run directory holds: its log and its checkpoints. Not its config.json: an export and
any downloaded model hold one too, and a project root may. A directory that holds only a config.json
is refused anyway when it is the target (not empty, no marker), and a run has logged or checkpointed
before anything exports it."""


def is_export(path: Path) -> bool:
    """Whether ``path`` is a directory an export wrote (it holds the marker)."""
    return path.is_dir() and (path / MARKER).is_file()


def run_signs(path: Path) -> list[str]:
    """The names in ``path`` that make it a run directory (``RUN_SIGNS``), sorted; [] if none."""
    return sorted({p.name for sign in RUN_SIGNS for p in path.glob(sign)}) if path.is_dir() else []


def temporary(target: Path) -> Path:
    """The sibling an export is written to before it is renamed over ``target``."""
    return target.parent / f".{target.name}.tmp"


def check_export_dir(path: str | Path, run_dir: str | Path | None = None, flag: str = "--out") -> Path:
    """The directory an export of the run in ``run_dir`` may write at ``path`` (absolute, symlinks
    resolved), or a one-line ValueError that starts with ``flag`` and ``path``. Reads only."""
    given = str(path)
    if not given.strip():
        raise ValueError(f"{flag} is empty (an unset shell variable?); give the directory to write the export to")
    said = f"{flag} {given}"
    link = Path(os.path.abspath(given))  # lexical: "./", "a/.." and a trailing slash are normalized here
    target = link.resolve()
    if link.is_symlink() and not target.is_dir():
        raise ValueError(f"{said} is a symlink to {target}, which is not a directory; give a directory")
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:  # rmtree of it would take the working directory with it
        where = "the current directory" if target == cwd else f"{target}, a parent of the current directory"
        raise ValueError(f"{said} is {where}; an export replaces its directory whole: give a new directory")
    run = Path(os.path.abspath(run_dir)).resolve() if run_dir is not None else None
    if run is not None and (target == run or target in run.parents):
        what = "the run directory" if target == run else f"a directory that contains the run directory {run}"
        raise ValueError(f"{said} is {what}; an export replaces its directory whole: give a new directory "
                         f"outside the run, or {run / FINAL}")
    _check_place(target, run, said)
    _check_replaceable(target, said)
    _check_replaceable(temporary(target), f"{said}: its temporary sibling")
    return target


def _check_place(target: Path, run: Path | None, said: str) -> None:
    """Not inside a run (except as its ``final/``), nor inside an earlier export."""
    parent = target.parent
    if target.name == FINAL and (parent == run or run_signs(parent)):
        return  # a run's own export; what lies above the run is the run's business (gradnorm.trainer.ownership)
    for above in target.parents:
        if above == run or run_signs(above):
            raise ValueError(f"{said} is inside the run directory {above}; the only export a run holds is "
                             f"{above / FINAL}: give that, or a directory outside the run")
        if is_export(above):
            raise ValueError(f"{said} is inside the export {above}, which a re-export replaces whole; "
                             "give a directory outside it")
    existing = next(p for p in [parent, *parent.parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{said} cannot be created: {existing} is a file")


def _check_replaceable(path: Path, said: str) -> None:
    """``path`` is absent, an empty directory, or a flat directory an export wrote."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        what = "a broken symlink" if path.is_symlink() else "a file"
        raise ValueError(f"{said} is {what}, not a directory ({path})")
    entries = sorted(p.name for p in path.iterdir())
    if is_export(path):
        nested = [name for name in entries if (path / name).is_dir()]
        if nested:  # an export is flat: these are someone else's, and replacing would delete them
            raise ValueError(f"{said} is an earlier export that now holds directories an export never writes "
                             f"({_names(nested)}); move them out, or give another directory")
        return
    signs = run_signs(path)
    if signs:
        raise ValueError(f"{said} holds a run ({_names(signs)}); an export replaces its directory whole: give a "
                         "new directory, or the run's final/")
    if entries:
        raise ValueError(f"{said} is a directory of files no export wrote ({_names(entries)}; no {MARKER}), "
                         "and an export replaces its directory whole: give a new or empty directory")


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


# ------------------------------------------------------------------ the writes


def create(path: Path) -> None:
    """A new directory (and its parents), marked as an export's before anything else goes in."""
    path.mkdir(parents=True)
    (path / MARKER).write_text("written by gradnorm's export; a re-export replaces this directory whole\n")


def remove(path: Path) -> None:
    """Delete ``path`` if it is an export's or empty; a one-line ValueError for anything else.

    Checked again at the moment of deletion, not only in the preflight: a run may last for days.
    """
    if not path.exists() and not path.is_symlink():
        return
    if is_export(path) and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()
    else:
        raise ValueError(f"{path} is not a directory gradnorm's export wrote (no {MARKER}); it is never deleted")
