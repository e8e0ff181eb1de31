"""Issue 54: whether the lines that a failed run prints name a way on that works as typed.

What must hold (gradnorm/trainer/guards/failures.py):
- a failed write with no checkpoint (--save-every 0) says that there is nothing to resume and how
  to start over, and that command works; with a checkpoint (the control) it names --resume, which works;
- out of memory claims intact checkpoints only where there are some.
"""

import errno
import os

import pytest
from tests.helpers.runfiles import metrics
from tests.helpers.trainer import TINY, one_error_line, run_main, tiny
from tests.reliability.test_disk_full import small_disk  # noqa: F401 (a fixture)

from gradnorm import train as train_module
from gradnorm.train import main
from gradnorm.trainer.checkpoint.store import latest_checkpoint


# ------------------------------------------------------------------ a failed write, with and without a checkpoint

FAILS = tiny(warmup_steps="0")  # the fault comes in a GRPO step: no warm-up before it


def full_disk_at(monkeypatch, step: int) -> None:
    """The rollout of ``step`` fails as a write onto a full disk does (no file named: a buffered write)."""
    honest = train_module.generate_rollout

    def rollout(*args, **kwargs):
        if kwargs["step"] == step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return honest(*args, **kwargs)

    monkeypatch.setattr(train_module, "generate_rollout", rollout)


EXPLAINED_WITH_CFG = pytest.mark.xfail(strict=True, reason="Session._report does not pass the run's config to "
                                       "failures.explain(..., cfg) yet, so the line cannot look for a checkpoint")


@EXPLAINED_WITH_CFG
@pytest.mark.parametrize("save_every, says, way", [
    ("0", "no checkpoint was written, so there is nothing to resume: start the run over (the same command with "
          "--overwrite)", "--overwrite"),
    ("1", "the checkpoints written so far are intact, and --resume continues from the latest once the cause is fixed",
     "--resume"),
], ids=["save-every-0", "control-a-checkpoint"])
def test_a_failed_write_says_whether_there_is_a_checkpoint_to_resume_and_its_way_works(save_every, says, way,
                                                                                     tmp_path, monkeypatch, capsys):
    """Issue 54, finding: a run on a full disk with --save-every 0 was told "the checkpoints written so
    far are intact, --resume continues" when there were none (--resume then refused: no checkpoint)."""
    out = tmp_path / "run"
    command = ["--steps", "3", "--save-every", save_every]
    with monkeypatch.context() as patched:
        full_disk_at(patched, 3)
        assert run_main(out, *command, base=FAILS) == 1
    one_error_line(capsys.readouterr().err, f"step 3: could not write a file of the run (No space left on device); "
                                            f"{says}")
    assert run_main(out, *command, way, base=FAILS) == 0  # the way the line names, the cause gone
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["none", "control-one"])
def test_out_of_memory_claims_intact_checkpoints_only_where_there_are_some(checkpoint, tmp_path):
    """Issue 54, finding (the same line's other half): out of memory said "the checkpoints written so
    far are intact" with none written."""
    import torch

    from gradnorm.trainer.config import parse_config
    from gradnorm.trainer.guards.failures import explain

    cfg = parse_config([*FAILS, "--output-dir", str(tmp_path)])
    if checkpoint:
        (tmp_path / "ckpt_step2").mkdir()
    said = explain(torch.OutOfMemoryError("CUDA out of memory"), torch.device("cpu"), 3, cfg)
    assert said.startswith("step 3: out of memory on cpu (CUDA out of memory); raise --grad-accum-steps"), said
    assert said.endswith("; the checkpoints written so far are intact" if checkpoint else
                         "; no checkpoint was written, so there is nothing to resume: start the run over (the same "
                         "command with --overwrite)"), said


@EXPLAINED_WITH_CFG
@pytest.mark.launch
def test_a_real_full_disk_with_save_every_0_says_there_is_nothing_to_resume(small_disk, capsys):  # noqa: F811
    """Issue 54, finding: the same line from a real full disk (a tmpfs of 32 KiB that metrics.jsonl
    fills), where --save-every 0 leaves no checkpoint to resume from."""
    disk = small_disk(32 << 10)
    out = disk / "run"
    assert main([*TINY, "--output-dir", str(out), "--steps", "400", "--save-every", "0", "--log-every", "400"]) == 1
    one_error_line(capsys.readouterr().err, "(No space left on device); no checkpoint was written, so there is "
                                            "nothing to resume: start the run over (the same command with --overwrite)")
    assert latest_checkpoint(out) is None
