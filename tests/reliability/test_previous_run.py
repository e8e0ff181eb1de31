"""Issue 54: previous_run/, where --overwrite keeps the run it replaces; never a loss, never a dead end.

What must hold (gradnorm/trainer/ownership/lock.py):
- a move of the old run into previous_run/ that fails (a real mount point: EBUSY; a read-only
  checkpoint: EACCES, at every rename) is undone: the old run is whole where it was, no
  previous_run/, no journal, and the line (``MoveFailed``, exit 1) names the file and the cause;
- a previous_run that the trainer did not make is never moved into, out of or deleted: a file, a
  user's directory (notes, a backup, one an older gradnorm left), a symlink; a start that needs the
  name is refused in one line before anything moves, and its advice, typed as it reads, works;
- the trainer marks the previous_run/ it makes, deletes only a marked one, and says so when it does;
- a stranded --overwrite (SIGKILLed before its first checkpoint): a plain start is refused naming
  --resume and --overwrite (no ``mv``); --resume typed as named puts the old run back whole,
  tensorboard/ too, and continues it to the metrics of an uninterrupted run; --overwrite typed as
  named starts the replacement over and says when the old run goes.
The control of each refusal: the same directory with the trainer's own, marked previous_run/.
"""

import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.runfiles import comparable, every_file, old_run
from tests.helpers.trainer import TINY, one_error_line, run_main, tiny

from gradnorm.train import main
from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.ownership import lock
from gradnorm.trainer.ownership.lock import RunDir

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def nothing_moved(out: Path, before: dict[str, bytes]) -> None:
    """The old run is whole where it was, and no trace of a move is left."""
    assert every_file(out) == before
    assert not (out / lock.PREVIOUS).exists() and not (out / lock.JOURNAL).exists()
    assert not (out / (lock.JOURNAL + ".tmp")).exists() and not (out / lock.LOCK).exists()


# ------------------------------------------------------------------ a move that fails is undone


@pytest.mark.launch
def test_a_move_into_previous_run_that_fails_on_a_mount_point_is_undone(tmp_path, capsys):
    """Issue 54, finding: --overwrite whose move of an old checkpoint into previous_run/ failed (EBUSY on
    a mount point) took the old checkpoint still in place for the replacement's, deleted previous_run/
    (the old run's other checkpoints) and said "free space there". A failed move must undo."""
    out = tmp_path / "run"
    old_run(out)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out / "ckpt_step8")],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        (out / "ckpt_step8" / ".metadata").write_text("ckpt_step8")
        before = every_file(out)
        run_dir = RunDir(out)
        with pytest.raises(Exception) as failed:  # noqa: B017 (the old code raised an OSError)
            run_dir.open(resume=False, overwrite=True)  # three names move before ckpt_step8 (sorted)
        run_dir.close(succeeded=False)
        nothing_moved(out, before)
        assert isinstance(failed.value, lock.MoveFailed), failed.value
        said = str(failed.value)
        assert f"could not move {out / 'ckpt_step8'} into {out / lock.PREVIOUS}/ (Device or resource busy)" in said
        assert "free space" not in said and f"the old run is whole in {out}" in said
        # the trainer as a user runs it: one line, exit 1, and still nothing moved
        assert main([*TINY, "--output-dir", str(out), "--steps", "1", "--overwrite"]) == 1
        one_error_line(capsys.readouterr().err, "(Device or resource busy); nothing is moved or deleted")
        nothing_moved(out, before)
    finally:
        subprocess.run(["umount", str(out / "ckpt_step8")], capture_output=True)


def refuse_rename(monkeypatch, after: int, also_back: bool = False) -> None:
    """The rename after ``after`` renames fails as a read-only checkpoint does for a user (EACCES);
    ``also_back``: every later rename too, so the undo fails as well."""
    honest, done = lock._rename, [0]

    def rename(src, dst):
        if done[0] >= after and (also_back or done[0] == after):
            done[0] += 1
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(src), None, str(dst))
        honest(src, dst)
        done[0] += 1

    monkeypatch.setattr(lock, "_rename", rename)


@pytest.mark.parametrize("after", range(6))
def test_a_refused_rename_at_every_point_of_the_set_aside_is_undone(tmp_path, monkeypatch, after):
    """Issue 54, finding (the same, EACCES): every rename of the set-aside fails once; the move is undone."""
    out = tmp_path / "run"
    before = old_run(out)
    names = [p.name for p in lock.run_files(out)]
    assert len(names) == 6
    refuse_rename(monkeypatch, after)
    run_dir = RunDir(out)
    with pytest.raises(lock.MoveFailed, match=re.escape(f"could not move {out / names[after]} into "
                                                        f"{out / lock.PREVIOUS}/ (Permission denied)")):
        run_dir.open(resume=False, overwrite=True)
    run_dir.close(succeeded=False)
    nothing_moved(out, before)


def test_an_undo_that_fails_too_is_finished_by_the_next_start(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    before = old_run(out)
    refuse_rename(monkeypatch, 2, also_back=True)
    run_dir = RunDir(out)
    with pytest.raises(lock.MoveFailed, match="moving back what had moved failed too .*the next start in"):
        run_dir.open(resume=False, overwrite=True)
    run_dir.close(succeeded=False)  # leaves the half-moved run to the journal: it deletes nothing
    assert (out / lock.JOURNAL).is_file() and len(os.listdir(out / lock.PREVIOUS)) == 3  # 2 names and the marker
    monkeypatch.undo()
    lock.settle(out)
    assert "the move is undone and the old run is whole" in capsys.readouterr().err
    nothing_moved(out, before)


# ------------------------------------------------------------------ a previous_run the trainer did not make


def follow_mv(line: str) -> None:
    """Run the ``(mv A B)`` a line advises, as a user would type it."""
    advised = re.search(r"\(mv ([^()]+)\)", line)
    assert advised, line
    subprocess.run(["mv", *shlex.split(advised.group(1))], check=True)


@pytest.mark.launch
def test_a_file_named_previous_run_is_refused_before_anything_moves(tmp_path, capsys):
    """Issue 54, finding: a user's file named previous_run with --overwrite gave "could not write
    .../previous_run (File exists) ... free space there" and left a stale journal."""
    out = tmp_path / "run"
    old_run(out)
    (out / lock.PREVIOUS).write_text("my notes\n")
    (out / f"{lock.PREVIOUS}.kept").write_text("older notes\n")  # the advised name is one that mv writes over nothing
    before = every_file(out)
    flags = [*TINY, "--output-dir", str(out), "--steps", "1", "--overwrite"]
    assert main(flags) == 2
    line = one_error_line(capsys.readouterr().err, f"{out / lock.PREVIOUS} is a file, which the trainer never moves")
    assert "free space" not in line
    assert every_file(out) == before and not (out / lock.JOURNAL).exists()
    follow_mv(line)  # the advice, as typed: then the same command replaces the run
    assert main(flags) == 0
    err = capsys.readouterr().err
    assert (out / f"{lock.PREVIOUS}.kept1").read_text() == "my notes\n"
    assert (out / f"{lock.PREVIOUS}.kept").read_text() == "older notes\n"
    assert not (out / lock.PREVIOUS).exists() and latest_checkpoint(out).name == "ckpt_step1"
    assert f"so that old run is deleted now: {out / lock.PREVIOUS}/ is gone" in err  # the deletion is said


def test_a_users_previous_run_directory_is_never_deleted_or_moved_into(tmp_path, capsys):
    """Issue 54, finding: a user's own previous_run/ (notes, a backup) in a run directory was deleted
    by a plain --resume. Never delete what the trainer cannot prove it wrote, and say so when it does."""
    out = tmp_path / "run"
    old_run(out)
    (out / lock.PREVIOUS).mkdir()
    (out / lock.PREVIOUS / "notes.txt").write_text("mine\n")
    before = every_file(out)
    run_dir = RunDir(out)
    run_dir.open(resume=True, overwrite=False)  # the run has a checkpoint: the old code took it for replaced
    run_dir.close(succeeded=True)
    assert every_file(out) == before
    assert "deleted" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="is a directory the trainer did not make .*rename it \\(mv "):
        lock.check(out, resume=False, overwrite=True)  # --overwrite would need the name: refused
    # the control: the trainer's own previous_run/ (marked) is deleted once its replacement has a
    # checkpoint, and one warning line says so
    (out / lock.PREVIOUS / lock.PREVIOUS_MARKER).write_text("{}\n")
    lock.check(out, resume=False, overwrite=True)
    run_dir = RunDir(out)
    run_dir.open(resume=True, overwrite=False)
    said = [line for line in capsys.readouterr().err.splitlines() if "deleted" in line]
    assert said == [f"warning: {out} holds a checkpoint of the run that replaced the one in {out / lock.PREVIOUS}/ "
                    f"(ckpt_step10), so that old run is deleted now: {out / lock.PREVIOUS}/ is gone"]
    run_dir.close(succeeded=True)
    assert not (out / lock.PREVIOUS).exists()


@pytest.mark.launch
def test_a_previous_run_symlink_is_one_line_and_nothing_follows_it(tmp_path, capsys):
    """Issue 54, finding: a previous_run that is a symlink gave a double traceback through train.py."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    old_run(out)
    elsewhere.mkdir()
    (elsewhere / "backup.txt").write_text("kept\n")
    (out / lock.PREVIOUS).symlink_to(elsewhere)
    before, theirs = every_file(out), every_file(elsewhere)
    assert main([*TINY, "--output-dir", str(out), "--steps", "1", "--overwrite"]) == 2
    one_error_line(capsys.readouterr().err, f"{out / lock.PREVIOUS} is a symlink (to {elsewhere})")
    run_dir = RunDir(out)  # a --resume neither deletes it nor what it points to
    run_dir.open(resume=True, overwrite=False)
    run_dir.close(succeeded=True)
    assert every_file(out) == before and every_file(elsewhere) == theirs and (out / lock.PREVIOUS).is_symlink()


# ------------------------------------------------------------------ the stranded --overwrite


OLD = tiny(save_every="1", report_to="tensorboard")
"""The run an --overwrite replaces: a checkpoint every step, and tensorboard/ (a directory of records)."""

NEW = tiny(save_every="2", seed="4", report_to="tensorboard")
"""The replacement: another seed, its first checkpoint at step 2; killed in step 2, before it."""

KILL_AT_STEP = """
import os, signal, sys
from gradnorm import train
honest = train.generate_rollout
def rollout(*args, **kwargs):
    if kwargs["step"] == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill: no finally runs, nothing is put back
    return honest(*args, **kwargs)
train.generate_rollout = rollout
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def stranded(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """(a run directory, every file of the old run): an --overwrite SIGKILLed before its first checkpoint."""
    out = tmp_path_factory.mktemp("stranded") / "run"
    assert run_main(out, "--steps", "2", base=OLD) == 0
    old = every_file(out)
    killed = subprocess.run([sys.executable, "-c", KILL_AT_STEP, *NEW, "--output-dir", str(out), "--steps", "4",
                             "--overwrite"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert lock.stranded(out) and (out / "tensorboard").is_dir() and (out / lock.PREVIOUS / "tensorboard").is_dir()
    return out, old


@pytest.mark.launch
def test_a_stranded_overwrite_names_resume_and_resume_puts_the_old_run_back_whole(stranded, tmp_path, capsys):
    """Issue 54, finding: after a stranded --overwrite, the printed advice (``mv previous_run/* .``) left
    the old run's tensorboard/ behind, and the next --resume deleted previous_run/ without a word."""
    out = Path(shutil.copytree(stranded[0], tmp_path / "run", symlinks=True))
    old = stranded[1]
    before = every_file(out)
    assert run_main(out, "--steps", "4", base=OLD) == 2  # the old run's own command again (a requeue)
    line = one_error_line(capsys.readouterr().err, "holds the run that an --overwrite replaced")
    assert "rerun with --resume to put the old run back and continue it from its latest checkpoint ckpt_step2" in line
    assert "or with --overwrite to start the replacement over" in line and "mv " not in line
    assert every_file(out) == before
    # --resume, typed as named: the old run is back whole (tensorboard/ too) and continues
    assert run_main(out, "--steps", "4", "--resume", base=OLD) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --resume:")]
    assert len(said) == 1 and f"the old run is back in {out}" in said[0]
    assert not (out / lock.PREVIOUS).exists()
    now = every_file(out)
    assert all(now.get(name) == data for name, data in old.items()
               if name.startswith(("tensorboard/", "ckpt_step1/", "ckpt_step2/")))
    assert len([n for n in now if n.startswith("tensorboard/")]) > len([n for n in old if n.startswith("tensorboard/")])
    # the control for "continues it": the old run's metrics are those of its uninterrupted run
    assert run_main(tmp_path / "uninterrupted", "--steps", "4", base=OLD) == 0
    assert comparable(out) == comparable(tmp_path / "uninterrupted")


@pytest.mark.launch
def test_a_stranded_overwrite_typed_again_starts_over_and_says_when_the_old_run_goes(stranded, tmp_path, capsys):
    out = Path(shutil.copytree(stranded[0], tmp_path / "run", symlinks=True))
    assert run_main(out, "--steps", "4", base=NEW) == 2  # the replacement's command without --overwrite
    line = one_error_line(capsys.readouterr().err, "holds the run that an --overwrite replaced")
    assert "or with --overwrite to start the replacement over (the old run is deleted at its first checkpoint)" in line
    assert run_main(out, "--steps", "4", "--overwrite", base=NEW) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "deleted now" in line]
    assert said == [f"warning: {out} holds a checkpoint of the run that replaced the one in {out / lock.PREVIOUS}/ "
                    f"(ckpt_step4), so that old run is deleted now: {out / lock.PREVIOUS}/ is gone"]
    assert not (out / lock.PREVIOUS).exists() and latest_checkpoint(out).name == "ckpt_step4"


def test_resume_puts_back_an_old_run_without_a_checkpoint_and_says_that_nothing_trains(tmp_path, capsys):
    """A stranded --overwrite of a run that had no checkpoint yet: --resume is still the way back to
    it, and the refusal says that it only restores (resume_point then finds nothing to continue)."""
    out = tmp_path / "run"
    (out / lock.PREVIOUS).mkdir(parents=True)
    (out / lock.PREVIOUS / lock.PREVIOUS_MARKER).write_text("{}\n")
    (out / lock.PREVIOUS / lock.MARKER).write_text('{"old": true}\n')
    (out / lock.PREVIOUS / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / lock.PREVIOUS / "tensorboard").mkdir()
    (out / lock.PREVIOUS / "tensorboard" / "events.old").write_text("old events\n")
    old = {name: data for name, data in every_file(out / lock.PREVIOUS).items() if name != lock.PREVIOUS_MARKER}
    (out / lock.MARKER).write_text('{"new": true}\n')  # the replacement's partial files
    (out / "config.json").write_text('{"seed": 4, "history": []}\n')
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.new").write_text("new events\n")
    with pytest.raises(ValueError, match=re.escape("rerun with --resume to put the old run back (it has no "
                                                   "checkpoint, so nothing trains: it is only restored)")):
        lock.check(out, resume=False, overwrite=False)
    lock.check(out, resume=True, overwrite=False)
    run_dir = RunDir(out)
    run_dir.open(resume=True, overwrite=False)
    run_dir.close(succeeded=False)  # as after resume_point's "no complete checkpoint": nothing else goes
    assert every_file(out) == old and not (out / lock.PREVIOUS).exists()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --resume:")]
    assert len(said) == 1 and "the replacement's files (.gradnorm-run, config.json, tensorboard) are deleted" in said[0]
