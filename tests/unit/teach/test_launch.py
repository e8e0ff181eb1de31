"""Launching the trainer (``gradnorm.teach.launch``): the one torchrun command line, checked without a launch.

Real launches run in notebook 03 and in the trainer's end-to-end tests.
"""

import subprocess
import sys

import pytest

from gradnorm.teach import launch


def test_train_run_points_at_the_trainer():
    assert launch.TRAIN_SCRIPT.name == "train.py" and launch.TRAIN_SCRIPT.parent.name == "gradnorm"
    assert launch.TRAIN_SCRIPT.is_file()


def test_torchrun_command_longhand():
    assert launch.torchrun_command(2, "--steps", "3") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(launch.TRAIN_SCRIPT), "--steps", "3",
    ]
    assert launch.torchrun_command(4, script="gradnorm/train.py")[-2:] == ["--nproc_per_node=4", "gradnorm/train.py"]


def test_train_run_launches_that_command_and_reports_a_failure(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"], seen["env"] = cmd, kwargs["env"]
        return subprocess.CompletedProcess(cmd, returncode=3, stdout="", stderr="the trainer's last words")

    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="exit 3") as err:
        launch.train_run(tmp_path, loss_denominator="local", shard="balanced", steps=5)
    assert seen["cmd"] == launch.torchrun_command(
        2, "--loss-denominator", "local", "--shard", "balanced", "--grad-accum-steps", "2", "--steps", "5",
        "--seed", "0", "--output-dir", str(tmp_path), "--overwrite", "--no-plot", "--save-every", "0")
    assert seen["env"]["OMP_NUM_THREADS"] == "1"
    assert "the trainer's last words" in str(err.value)
