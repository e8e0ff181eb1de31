"""--overwrite moves a run by many renames; a kill between any two leaves a run that is whole.

Setting the old run aside into previous_run/ and putting it back are journalled
(``lock.JOURNAL``), and the next start finishes the move back before any rank reads the
directory (``lock.settle``, on rank 0, whose decision the other ranks learn). Every rename window is tried: the move is interrupted after k renames
for every k (the hook is ``lock._rename``; a real SIGKILL at one of them runs the trainer as a
process). The control for each: the directory as the kill left it really is half a run, with a
latest checkpoint that is not the run's latest, which is what the next ``--resume`` used to
continue from. Run detection is by the trainer's marker: a user's own config.json and wandb/ are
not a run, and neither a fresh start nor --overwrite touches them.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.faults import dead_pid
from tests.helpers.runfiles import every_file, old_run
from tests.helpers.trainer import TINY, one_error_line

from gradnorm.train import main
from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.ownership import lock
from gradnorm.trainer.ownership.lock import RunDir

ROOT = Path(__file__).resolve().parents[2]


def die(out: Path) -> None:
    """What the kernel leaves of a killed owner: its lock, naming a pid that no longer runs, held by
    no process. (The in-process "kill" keeps the RunDir's descriptor, and its flock, open: the lock
    file is written anew so that what it held is not what the next start finds.)"""
    (out / lock.LOCK).unlink(missing_ok=True)
    (out / lock.LOCK).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "started": "then"}))


class Killed(BaseException):
    """The process dies here: nothing after it runs (not RunDir.close, not a finally of the trainer's)."""


def kill_after(monkeypatch, renames: int) -> None:
    done = [0]
    rename = lock._rename

    def counted(src, dst):
        if done[0] == renames:
            raise Killed
        rename(src, dst)
        done[0] += 1

    monkeypatch.setattr(lock, "_rename", counted)


@pytest.mark.launch
@pytest.mark.parametrize("renames", range(6))
def test_a_kill_while_the_old_run_is_set_aside_leaves_it_whole(tmp_path, monkeypatch, capsys, renames):
    out = tmp_path / "run"
    before = old_run(out)
    kill_after(monkeypatch, renames)
    with pytest.raises(Killed):
        RunDir(out).open(resume=False, overwrite=True)
    monkeypatch.undo()
    die(out)
    assert (out / lock.JOURNAL).is_file()
    if renames == 3:  # the control (the torn one and the marker moved, then ckpt_step10): as the kill left it, the latest checkpoint in out is not the run's latest
        assert latest_checkpoint(out).name == "ckpt_step8"
    lock.settle(out)  # the next start, whatever its flags
    assert "interrupted while it set the old run aside" in capsys.readouterr().err
    assert every_file(out) == before
    assert not (out / lock.PREVIOUS).exists() and not (out / lock.JOURNAL).exists()
    assert not (out / lock.LOCK).exists()  # settle released the lock it took
    lock.check(out, resume=True, overwrite=False)
    assert latest_checkpoint(out).name == "ckpt_step10"


@pytest.mark.launch
@pytest.mark.parametrize("renames", range(6))
def test_a_kill_while_the_old_run_is_put_back_leaves_it_whole(tmp_path, monkeypatch, capsys, renames):
    out = tmp_path / "run"
    before = old_run(out)
    run_dir = RunDir(out)
    run_dir.open(resume=False, overwrite=True)
    (out / "config.json").write_text('{"seed": 5, "history": []}\n')  # the replacement's records, then a stop
    (out / "warmup.json").write_text("{}\n")  # in its warm-up (SIGTERM): its files go, the old run comes back
    kill_after(monkeypatch, renames)
    with pytest.raises(Killed):
        run_dir.close(succeeded=False)
    monkeypatch.undo()
    die(out)
    if renames == 0:  # the control: out holds the replacement's leftovers and no run's checkpoint at all
        assert latest_checkpoint(out) is None and (out / lock.PREVIOUS / "ckpt_step10").is_dir()
    lock.settle(out)
    assert "interrupted while it put the old run back" in capsys.readouterr().err
    assert every_file(out) == before
    assert sorted(os.listdir(out)) == sorted({Path(p).parts[0] for p in before})


def test_a_move_that_runs_to_the_end_leaves_no_journal(tmp_path):
    out = tmp_path / "run"
    before = old_run(out)
    run_dir = RunDir(out)
    run_dir.open(resume=False, overwrite=True)
    assert not (out / lock.JOURNAL).exists()
    # the old run's names, and the marker that says the trainer made previous_run/
    assert sorted(os.listdir(out / lock.PREVIOUS)) == sorted({lock.PREVIOUS_MARKER, *{Path(p).parts[0] for p in before}})
    run_dir.close(succeeded=False)
    assert not (out / lock.JOURNAL).exists() and every_file(out) == before


@pytest.mark.parametrize("journal", [
    '{"move": "sideways"}',
    '{"move": "back", "names": ["ckpt_step1"], "discard": [".."]}',  # would delete the directory above the run
    '{"move": "back", "names": [""], "discard": []}',  # out / "" is the run directory itself
    '{"move": "aside", "names": "ckpt_step1"}',
    '{"move": "aside", "names": ["a/b"]}',
])
def test_a_torn_journal_is_one_line_naming_the_way_out(journal, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / lock.JOURNAL).write_text(journal)
    with pytest.raises(ValueError, match="is unreadable: it records a move of a run"):
        lock.settle(out)
    assert out.is_dir() and tmp_path.is_dir()
    # the control: a whole journal reads, with the discard list it may leave out
    (out / lock.JOURNAL).write_text('{"move": "aside", "names": ["ckpt_step1"]}')
    assert lock._read_journal(out / lock.JOURNAL) == {"move": "aside", "names": ["ckpt_step1"], "discard": []}


KILL_AT = """
import os, signal, sys
from gradnorm.trainer.ownership import lock
rename, done = lock._rename, [0]
def counted(src, dst):
    rename(src, dst)
    done[0] += 1
    if done[0] == {renames}:
        os.kill(os.getpid(), signal.SIGKILL)
lock._rename = counted
from gradnorm.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.launch
def test_a_real_sigkill_inside_an_overwrite_then_resume_continues_the_old_run(tmp_path, capsys):
    out = tmp_path / "run"
    flags = [*TINY, "--output-dir", str(out), "--save-every", "1"]
    assert main([*flags, "--steps", "3"]) == 0
    capsys.readouterr()
    before = every_file(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILL_AT.format(renames=2), *flags, "--steps", "3", "--overwrite"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert (out / lock.JOURNAL).is_file() and latest_checkpoint(out).name == "ckpt_step3"  # ckpt_step1 moved
    assert sorted(os.listdir(out / lock.PREVIOUS)) == sorted([lock.MARKER, lock.PREVIOUS_MARKER, "ckpt_step1"])
    # the next command is the --resume that "holds a run" suggests: it continues from the run's latest step
    assert main([*flags, "--steps", "4", "--resume"]) == 0
    assert "interrupted while it set the old run aside" in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("ckpt_step*")) == ["ckpt_step1", "ckpt_step2", "ckpt_step3", "ckpt_step4"]
    assert all(every_file(out)[name] == data for name, data in before.items() if name.startswith("ckpt_step1/"))
    assert not (out / lock.PREVIOUS).exists()


def test_a_users_own_files_are_not_a_run_and_nothing_touches_them(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "wandb").mkdir(parents=True)
    (out / "config.json").write_text('{"learning_rate": 0.1}\n')
    (out / "wandb" / "settings").write_text("mine\n")
    before = every_file(out)
    for extra in ([], ["--overwrite"], ["--auto-resume"]):
        assert main([*TINY, "--output-dir", str(out), "--steps", "1", *extra]) == 2
        one_error_line(capsys.readouterr().err, "holds config.json, wandb/, which no gradnorm run wrote")
        assert every_file(out) == before and sorted(os.listdir(out)) == ["config.json", "wandb"]
    # the control: the same names with the trainer's marker are a run, which --overwrite may replace
    (out / lock.MARKER).write_text("{}\n")
    assert main([*TINY, "--output-dir", str(out), "--steps", "1"]) == 2
    one_error_line(capsys.readouterr().err, "holds a run (")


def test_a_run_from_before_the_marker_is_still_a_run(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "config.json").write_text('{"seed": 3, "history": [{"started": "then", "step": 0}]}\n')
    assert lock.is_run(out) and lock.run_files(out) == [out / "config.json"]
    with pytest.raises(ValueError, match="holds a run"):
        lock.check(out, resume=False, overwrite=False)

