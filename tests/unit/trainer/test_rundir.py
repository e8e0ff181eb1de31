"""The run directory with directory checkpoints: only a complete ``ckpt_step{N}/`` counts.

gradnorm.trainer.ownership decides from what --output-dir holds whether an --overwrite's replacement has
reached a checkpoint, and so whether the old run set aside in previous_run/ may go. A save killed
mid-write leaves a ``.ckpt_step{N}.tmp/`` that must not count; what a run left, checkpoint
directories and torn ones included, is set aside and put back whole. A save that fails says how
to go on, and that way works. (The whole-run cases are in tests/reliability/test_bad_input_runtime.py.)
"""

import json
import os
import socket
from pathlib import Path

import pytest
from tests.helpers.faults import dead_pid, fail_in_publish
from tests.helpers.runfiles import every_file
from tests.helpers.trainer import TINY, one_error_line

from gradnorm.train import main
from gradnorm.trainer.ownership import lock
from gradnorm.trainer.ownership.lock import RunDir


def checkpoint(run: Path, name: str) -> None:
    """``run/name`` shaped like a checkpoint directory (ownership never reads what is inside)."""
    (run / name).mkdir(parents=True)
    (run / name / ".metadata").write_bytes(name.encode())
    (run / name / "__0_0.distcp").write_bytes(b"shard of " + name.encode())


def replaced_run(tmp_path: Path, replacement_saved: str) -> Path:
    """An --overwrite that stopped without cleaning up (SIGKILL): the old run in previous_run/, the
    replacement's config.json and, as its only checkpoint, ``replacement_saved``."""
    out = tmp_path / "run"
    checkpoint(out / lock.PREVIOUS, "ckpt_step2")
    (out / lock.PREVIOUS / lock.PREVIOUS_MARKER).write_text("{}\n")  # the trainer marks the previous_run/ it makes
    (out / lock.PREVIOUS / "config.json").write_text('{"seed": 3}')
    (out / "config.json").write_text('{"seed": 5}')
    checkpoint(out, replacement_saved)
    return out


@pytest.mark.launch
def test_a_live_overwrite_run_is_in_use_not_stranded(tmp_path):
    # An --overwrite run in its warm-up: previous_run/ and no checkpoint yet, and its lock is live.
    out = tmp_path / "run"
    (out / lock.PREVIOUS).mkdir(parents=True)
    (out / lock.PREVIOUS / lock.PREVIOUS_MARKER).write_text("{}\n")
    (out / lock.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}))
    with pytest.raises(ValueError, match="is in use by another run"):
        lock.check(out, resume=True, overwrite=False)
    # the control: the same directory once that run is dead (its pid gone) is a stranded replacement
    dead = dead_pid()
    (out / lock.LOCK).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "started": "then"}))
    with pytest.raises(ValueError, match="stopped before its first checkpoint"):
        lock.check(out, resume=False, overwrite=False)  # --resume is a way out of it now (it puts the old run back)


def test_a_torn_checkpoint_does_not_release_the_old_run(tmp_path):
    out = replaced_run(tmp_path, ".ckpt_step1.tmp")  # killed while writing its first checkpoint
    with pytest.raises(ValueError, match="holds the run that an --overwrite replaced, and the replacement stopped"):
        lock.check(out, resume=False, overwrite=False)
    lock.check(out, resume=True, overwrite=False)  # a way out: --resume puts the old run back (RunDir.open)
    lock.check(out, resume=False, overwrite=True)  # the way out: --overwrite again
    run_dir = RunDir(out)
    run_dir.open(resume=False, overwrite=True)  # the replacement's files go, the torn directory too
    assert sorted(os.listdir(out)) == [lock.MARKER, ".lock", lock.PREVIOUS]  # and the new run's marker is first
    run_dir.close(succeeded=False)  # and this one stops before a checkpoint as well: the old run is back
    assert sorted(os.listdir(out)) == ["ckpt_step2", "config.json"]
    assert (out / "config.json").read_text() == '{"seed": 3}'


def test_a_complete_checkpoint_releases_the_old_run(tmp_path):
    out = replaced_run(tmp_path, "ckpt_step1")  # killed after its first checkpoint
    lock.check(out, resume=True, overwrite=False)
    run_dir = RunDir(out)
    run_dir.open(resume=True, overwrite=False)
    assert sorted(os.listdir(out)) == [lock.MARKER, ".lock", "ckpt_step1", "config.json"]
    run_dir.close(succeeded=True)


def test_overwrite_sets_aside_checkpoint_directories_and_torn_ones_and_puts_them_back(tmp_path):
    out = tmp_path / "run"
    checkpoint(out, "ckpt_step2")
    checkpoint(out, ".ckpt_step4.tmp")  # the old run was killed while saving step 4
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = every_file(out)
    run_dir = RunDir(out)
    run_dir.open(resume=False, overwrite=True)
    assert sorted(os.listdir(out)) == [lock.MARKER, ".lock", lock.PREVIOUS]
    assert sorted(os.listdir(out / lock.PREVIOUS)) == sorted([lock.PREVIOUS_MARKER, ".ckpt_step4.tmp", "ckpt_step2",
                                                             "metrics.jsonl"])
    checkpoint(out, ".ckpt_step4.tmp")  # the new run is interrupted (Ctrl-C) inside a save of the same step
    (out / "metrics.jsonl").write_text('{"step": 1, "new": true}\n')
    run_dir.close(succeeded=False)
    assert every_file(out) == before


def test_a_first_save_that_fails_says_how_to_start_again_and_that_way_works(tmp_path, monkeypatch, capsys):
    out, flags = tmp_path / "run", [*TINY, "--output-dir", str(tmp_path / "run"), "--steps", "2", "--save-every", "1"]
    fail_in_publish(monkeypatch, step=1)
    assert main(flags) == 1
    err = capsys.readouterr().err
    one_error_line(err, f"error: step 1: could not write checkpoint {out / 'ckpt_step1'} (")
    assert "there is no earlier checkpoint; once the cause is fixed (disk space, permissions), --overwrite starts " \
        "the run again" in err
    monkeypatch.undo()
    # step 1 was logged, so the directory holds a run, with no checkpoint to resume from: what it said is the way
    assert main(flags) == 2
    one_error_line(capsys.readouterr().err, "holds a run")
    assert main([*flags, "--resume"]) == 2
    one_error_line(capsys.readouterr().err, "no complete checkpoint")
    assert main([*flags, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir() if "ckpt" in p.name) == ["ckpt_step1", "ckpt_step2"]
