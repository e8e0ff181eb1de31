"""``--auto-resume``: the same command line for the first start and every restart of a run.

What must hold (gradnorm/trainer/rundir/restart.py):
- in process: a fresh directory starts the run; the same command with more --steps continues it
  to the metrics of an uninterrupted run; the same command on a complete run exits 0 and touches
  nothing; this run's files from before its first checkpoint are started over; another run (a
  flag that defines it differs), files without a config.json, and --auto-resume with --resume or
  --overwrite are each one ``error:`` line, exit 2, nothing written;
- under ``torchrun --max-restarts 2`` (slow): a worker SIGKILLed once the run has a checkpoint,
  the group restarts, the run continues from its latest checkpoint by itself and its
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
from runfiles import comparable, metrics  # tests/runfiles.py

from gradnorm.teach.launch import torchrun_command
from gradnorm.train import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--prompts-per-step", "2", "--group-size", "2", "--warmup-steps", "2", "--eval-prompts", "2",
        "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--no-plot", "--seed", "3"]


def run_main(out: Path, *flags: str) -> int:
    return main([*TINY, "--output-dir", str(out), "--save-every", "2", *flags])


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def snapshot(out: Path) -> dict:
    return {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")}


def test_the_same_command_starts_continues_and_then_has_nothing_to_do(tmp_path, capsys):
    out, full = tmp_path / "run", tmp_path / "full"
    assert run_main(out, "--steps", "2", "--auto-resume") == 0  # the first start: a fresh run
    assert [m["step"] for m in metrics(out)] == [1, 2]
    capsys.readouterr()
    assert run_main(out, "--steps", "4") == 2  # the control: a restart without it is refused
    assert "holds a run" in capsys.readouterr().err
    assert run_main(out, "--steps", "4", "--auto-resume") == 0  # a restart: continues from ckpt_step2
    assert run_main(full, "--steps", "4") == 0
    assert comparable(out) == comparable(full)  # the control run was never interrupted
    capsys.readouterr()
    before = snapshot(out)
    assert run_main(out, "--steps", "4", "--auto-resume") == 0  # a requeue of a finished run
    assert "is complete at step 4 (--steps 4): nothing to do" in capsys.readouterr().err
    assert snapshot(out) == before


def test_this_runs_files_from_before_a_first_checkpoint_are_started_over(tmp_path):
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    assert run_main(out, "--steps", "2") == 0
    for ckpt in out.glob("ckpt_step*"):  # as if it died before its first checkpoint
        shutil.rmtree(ckpt)
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    assert run_main(out, "--steps", "2", "--auto-resume") == 0
    assert run_main(fresh, "--steps", "2") == 0
    assert comparable(out) == comparable(fresh)
    assert not (out / "previous_run").exists()  # the leftovers went once the new run had a checkpoint


@pytest.mark.parametrize("flags, says", [
    (["--seed", "4"], "--auto-resume: the flags that define the run differ from"),
    (["--resume"], "--auto-resume decides by itself whether to start, resume or start over: drop --resume"),
    (["--overwrite"], "drop --overwrite"),
], ids=["another-run", "with-resume", "with-overwrite"])
def test_another_run_or_a_second_start_flag_is_one_line_and_nothing_is_written(flags, says, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2") == 0
    capsys.readouterr()
    before = snapshot(out)
    assert run_main(out, "--steps", "4", "--auto-resume", *flags) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and says in errors[0], errors
    assert snapshot(out) == before


def test_a_run_without_config_json_is_not_taken_for_this_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2") == 0
    (out / "config.json").unlink()
    capsys.readouterr()
    assert run_main(out, "--steps", "4", "--auto-resume") == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "but no config.json to tell whether it is this run" in errors[0], errors


# ------------------------------------------------------------------ an elastic restart under torchrun

ELASTIC = ["--steps", "12", "--save-every", "4", "--timeout-s", "10"]


@pytest.mark.slow
def test_an_elastic_restart_after_a_sigkill_continues_the_run_by_itself(tmp_path):
    psutil = pytest.importorskip("psutil")
    restarted, full = tmp_path / "restarted", tmp_path / "full"
    command = torchrun_command(2, *TINY, "--output-dir", str(restarted), *ELASTIC, "--auto-resume")
    command.insert(command.index("--standalone") + 1, "--max-restarts=2")
    job = subprocess.Popen(command, cwd=ROOT, env=ENV, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    reference = subprocess.Popen(torchrun_command(2, *TINY, "--output-dir", str(full), *ELASTIC), cwd=ROOT, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (restarted / "ckpt_step8").exists():  # the marker: the run's second checkpoint
            assert job.poll() is None and time.monotonic() < deadline, "the run ended before its 2nd checkpoint"
            time.sleep(0.02)
        workers = [p for p in psutil.Process(job.pid).children(recursive=True)
                   if "gradnorm/train.py" in " ".join(p.cmdline())]
        victim = next(p for p in workers if p.environ().get("RANK") == "1")
        os.kill(victim.pid, signal.SIGKILL)
        output, _ = job.communicate(timeout=180)
        reference_output, _ = reference.communicate(timeout=180)
    finally:
        for proc in (job, reference):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert reference.returncode == 0, reference_output[-3000:]
    assert job.returncode == 0, output[-3000:]  # torchrun restarted the group and the run finished
    assert "died or left the process group" in output  # rank 0's line about the SIGKILL
    steps = [m["step"] for m in metrics(restarted)]
    assert steps == list(range(1, 13)), steps  # every step once: the steps after ckpt_step8 were cut
    assert comparable(restarted) == comparable(full)
    history = json.loads((restarted / "config.json").read_text())["history"]
    assert [h.get("changed") for h in history] == [None, {}]  # one fresh start, one resume that changed no flag
