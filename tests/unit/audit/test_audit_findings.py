"""What real SFT/DPO/GRPO code met in the audit's words, each fixed against a loss written out longhand.

- ``decide.decide`` is the public entry for weights read elsewhere (the trainer audit): it gives
  back the report ``audit`` gives, from the same results; a changed weight is told apart (control).
- A step passed without ``--step`` is pointed at it.
- The command's child: a loss that leaves a thread running, closes stdout or raises GeneratorExit
  gets its verdict (or its own failure named); a SIGTERM ends the command with one line, exit 143,
  and the child with it.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.audit_command import run, verdict_of

from gradnorm.audit import conventions, decide, verdict

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the public entry ------------------------------------------------------------------------------

def test_decide_gives_the_audits_report_from_the_same_results():
    report = decide.audit(conventions.token_sum_over_global_count, (2,), (4,), objective="grpo")
    again = decide.decide(report.name, report.batch, report.results, objective="grpo", tol=report.tol)
    assert verdict.format_report(again) == verdict.format_report(report)
    assert again.exit_code == report.exit_code == 0
    # Control: one rank's tokens doubled in one configuration is no longer invariant.
    results = [*report.results[:-1], report.results[-1]]
    last = results[-1]
    doubled = last.weights.clone()
    doubled[last.plan[0][0]] *= 2
    results[-1] = type(last)(last.label, last.plan, doubled, torch.zeros_like(doubled),
                             update_share=last.update_share, token_share=last.token_share)
    skewed = decide.decide(report.name, report.batch, results, objective="grpo", tol=report.tol)
    assert skewed.exit_code == 1 and verdict.verdict(skewed).startswith("SKEWED")


# --- a step audited as a microbatch loss -----------------------------------------------------------

def a_step(microbatches, *, world_size):
    """An SFT step: every label token over the step's global count, times W (DDP's mean undone)."""
    for mb in microbatches:
        (-(mb["logp"] * mb["mask"]).sum() / mb["num_tokens"] * world_size).backward()


def a_loss_of_three_positional_arguments(logits, labels, weights):
    """Not a step, and refused all the same (SFT passes two): its refusal names no --step (the control)."""
    return logits.sum()


def test_a_step_passed_without_step_is_pointed_at_step(capsys):
    code, out, err = run(capsys, f"{__name__}:a_step", "--objective", "sft", "--world-size", "2")
    assert code == 2 and out == "" and "too many positional arguments" in err
    assert "its first parameter is `microbatches`, a rank's step? audit it with --step" in err
    code, out, _ = run(capsys, f"{__name__}:a_step", "--objective", "sft", "--world-size", "2", "--step")
    assert code == 0 and verdict_of(out).startswith("verdict: INVARIANT")
    code, _, err = run(capsys, f"{__name__}:a_loss_of_three_positional_arguments", "--objective", "sft",
                       "--world-size", "2")
    assert code == 2 and "cannot take the audit's arguments" in err and "--step" not in err


# --- the command's child: what the loss does to its process ----------------------------------------

CHILD_LOSSES = '''
import os, pathlib, sys, threading, time

def _fix(logp, mask, num_tokens, world_size):
    return -(logp * mask).sum() / num_tokens * world_size

def leaves_a_thread(logp, mask, *, num_tokens, world_size):
    threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: it never ends
    return _fix(logp, mask, num_tokens, world_size)

def closes_stdout(logp, mask, *, num_tokens, world_size):
    sys.stdout.close()
    return _fix(logp, mask, num_tokens, world_size)

def raises_generator_exit(logp, mask, *, num_tokens, world_size):
    raise GeneratorExit

def waits(logp, mask, *, num_tokens, world_size):
    pathlib.Path(__file__).with_name("pid").write_text(str(os.getpid()))  # the marker: inside the loss
    time.sleep(3600)
'''

ONE_RUN = ("--objective", "sft", "--world-size", "2", "--accum-steps", "1", "--sharding", "interleave")


def _command(tmp_path, name, *argv, timeout=120):
    (tmp_path / "child_losses.py").write_text(CHILD_LOSSES)
    return subprocess.run([sys.executable, "-m", "gradnorm.audit", f"{tmp_path / 'child_losses.py'}:{name}",
                           *ONE_RUN, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.launch
def test_a_loss_that_leaves_a_thread_running_gets_its_verdict(tmp_path):
    """Before, the child sent its report and then waited on the thread in the interpreter's shutdown,
    and the command waited on the child, past --timeout, forever."""
    done = _command(tmp_path, "leaves_a_thread", "--timeout", "60")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert verdict_of(done.stdout).startswith("verdict: INVARIANT")


@pytest.mark.launch
def test_a_loss_that_closes_stdout_gets_its_verdict_and_a_generator_exit_is_the_loss_s(tmp_path):
    done = _command(tmp_path, "closes_stdout")
    assert done.returncode == 0 and done.stderr == "" and "os._exit" not in done.stdout, done.stderr
    assert verdict_of(done.stdout).startswith("verdict: INVARIANT")
    done = _command(tmp_path, "raises_generator_exit")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("error: the loss raised GeneratorExit") and "the audit failed" not in done.stderr


@pytest.mark.launch
def test_sigterm_ends_the_command_with_one_line_and_takes_the_child_with_it(tmp_path):
    (tmp_path / "child_losses.py").write_text(CHILD_LOSSES)
    proc = subprocess.Popen([sys.executable, "-m", "gradnorm.audit", f"{tmp_path / 'child_losses.py'}:waits",
                             *ONE_RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "pid"
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip() == "error: terminated (SIGTERM): no report" and out == ""
    child = int(marker.read_text())
    assert not _alive(child), "the loss's process outlived the command"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and waiting to be reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
