"""``--auto-resume``: the same command line for the first start and every restart of a run.

What must hold (gradnorm/trainer/ownership/restart.py):
- in process: a fresh directory starts the run; the same command with more --steps continues it
  to the metrics of an uninterrupted run; the same command on a complete run exits 0 and touches
  nothing; this run's files from before its first checkpoint are started over; another run (a
  flag that defines it differs), files without a config.json, and --auto-resume with --resume or
  --overwrite are each one ``error:`` line, exit 2, nothing written;
- under ``torchrun --max-restarts 2`` (slow): rank 1 SIGKILLed inside a checkpoint's write, then
  again once that checkpoint exists; each time the group restarts and meets afresh, the run
  continues from its latest complete checkpoint by itself (the torn one ignored), and its
  metrics.jsonl equals an uninterrupted run's (every step once, rows equal but for timings).
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tests.helpers.faults import rank_1_worker, wait_for_file
from tests.helpers.launches import KILLED
from tests.helpers.runfiles import comparable, metrics
from tests.helpers.trainer import run_main, tiny, torchrun_cmd


ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# TINY with a checkpoint every 2 steps, so that a restart of these short runs has one to continue from
RESTARTABLE = tiny(save_every="2")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def snapshot(out: Path) -> dict:
    return {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")}


def test_the_same_command_starts_continues_and_then_has_nothing_to_do(tmp_path, capsys):
    out, full = tmp_path / "run", tmp_path / "full"
    assert run_main(out, "--steps", "2", "--auto-resume", base=RESTARTABLE) == 0  # the first start: a fresh run
    assert [m["step"] for m in metrics(out)] == [1, 2]
    capsys.readouterr()
    assert run_main(out, "--steps", "4", base=RESTARTABLE) == 2  # the control: a restart without it is refused
    assert "holds a run" in capsys.readouterr().err
    assert run_main(out, "--steps", "4", "--auto-resume", base=RESTARTABLE) == 0  # a restart: continues from ckpt_step2
    assert run_main(full, "--steps", "4", base=RESTARTABLE) == 0
    assert comparable(out) == comparable(full)  # the control run was never interrupted
    capsys.readouterr()
    before = snapshot(out)
    assert run_main(out, "--steps", "4", "--auto-resume", base=RESTARTABLE) == 0  # a requeue of a finished run
    assert "is complete at step 4 (--steps 4): nothing to do" in capsys.readouterr().err
    assert snapshot(out) == before


def test_this_runs_files_from_before_a_first_checkpoint_are_started_over(tmp_path):
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    assert run_main(out, "--steps", "2", base=RESTARTABLE) == 0
    for ckpt in out.glob("ckpt_step*"):  # as if it died before its first checkpoint
        shutil.rmtree(ckpt)
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    assert run_main(out, "--steps", "2", "--auto-resume", base=RESTARTABLE) == 0
    assert run_main(fresh, "--steps", "2", base=RESTARTABLE) == 0
    assert comparable(out) == comparable(fresh)
    assert not (out / "previous_run").exists()  # the leftovers went once the new run had a checkpoint


@pytest.mark.parametrize("flags, says", [
    (["--seed", "4"], "--auto-resume: the flags that define the run differ from"),
    (["--resume"], "--auto-resume decides by itself whether to start, resume or start over: drop --resume"),
    (["--overwrite"], "drop --overwrite"),
], ids=["another-run", "with-resume", "with-overwrite"])
def test_another_run_or_a_second_start_flag_is_one_line_and_nothing_is_written(flags, says, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2", base=RESTARTABLE) == 0
    capsys.readouterr()
    before = snapshot(out)
    assert run_main(out, "--steps", "4", "--auto-resume", *flags, base=RESTARTABLE) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and says in errors[0], errors
    assert snapshot(out) == before


def test_a_run_without_config_json_is_not_taken_for_this_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2", base=RESTARTABLE) == 0
    (out / "config.json").unlink()
    capsys.readouterr()
    assert run_main(out, "--steps", "4", "--auto-resume", base=RESTARTABLE) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "but no config.json to tell whether it is this run" in errors[0], errors


# ------------------------------------------------------------------ an elastic restart under torchrun

@pytest.mark.slow
def test_an_elastic_restart_after_a_sigkill_continues_the_run_by_itself(tmp_path, launched):
    """Two kills of rank 1, each at a marker the run writes: once inside the write of ckpt_step8 (its
    shard is on disk, the checkpoint not yet published), then once ckpt_step8 exists. The
    uninterrupted twin is the session's shared run (tests/helpers/launches.py), launched beside."""
    psutil = pytest.importorskip("psutil")
    restarted = tmp_path / "restarted"
    launched.start("twin-w2-24")
    command = torchrun_cmd(restarted, *KILLED, "--auto-resume")
    command.insert(command.index("--standalone") + 1, "--max-restarts=2")
    job = subprocess.Popen(command, cwd=ROOT, env=ENV, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        wait_for_file(restarted / ".ckpt_step8.tmp" / "__1_0.distcp", job, deadline)  # rank 1 is writing its part
        first = rank_1_worker(psutil, job.pid)
        os.kill(first.pid, signal.SIGKILL)
        torn = not (restarted / "ckpt_step8").exists()  # the kill landed before the checkpoint was published
        # the restarted group resumes from ckpt_step4; find its new rank 1 before it writes ckpt_step8 again
        while (second := rank_1_worker(psutil, job.pid, not_pid=first.pid)) is None:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        wait_for_file(restarted / "ckpt_step8", job, deadline)  # written again after the restart
        os.kill(second.pid, signal.SIGKILL)
        output, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    full = launched("twin-w2-24")
    assert torn, "the first kill came after ckpt_step8 was published: it did not test a kill mid-write"
    assert job.returncode == 0, output[-3000:]  # torchrun restarted the group twice and the run finished
    assert "could not join the process group" not in output  # a restarted group meets afresh
    assert output.count("died or left the process group") == 2  # rank 0's line about each SIGKILL
    assert f"resumed from {restarted / 'ckpt_step4'} at step 4" in output  # the torn ckpt_step8 was not used
    assert f"resumed from {restarted / 'ckpt_step8'} at step 8" in output
    assert not list(restarted.glob(".ckpt_step*.tmp"))
    steps = [m["step"] for m in metrics(restarted)]
    assert steps == list(range(1, 25)), steps  # every step once: the steps after each checkpoint were cut
    assert comparable(restarted) == comparable(full)
    history = json.loads((restarted / "config.json").read_text())["history"]
    assert [h.get("changed") for h in history] == [None, {}, {}]  # one start, two resumes that changed no flag
