"""A failure on one rank reaches every rank as one line: rank 0 prints the failing rank's message,
or names the rank that stopped responding, and no rank prints a traceback.

Two real torchrun launches of 2 gloo ranks (the built-in task, a few steps), started together:
a reward that raises on rank 1 only, in its rollout of step 2 (before: rank 1 waited 30 s, then rank 0
died in a gloo "Connection reset by peer" traceback), and a rank 1 that hangs in that rollout,
so that rank 0's next collective times out after --timeout-s (before: a gloo "Timed out" traceback),
and a rank 1 killed (SIGKILL) inside the checkpoint's writer while rank 0 writes its own shards
(before: rank 0's traceback from the save's success all-reduce).
Faults are injected by a wrapper script, not by a hook in the trainer.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.trainer import tiny

from gradnorm.teach.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[2]
# TINY without the warm-up (the fault comes in step 2's rollout, counted in reward calls), on the
# trainer's default seed as this module always ran, 3 steps, and a 10 s collective timeout so that
# a hung rank is named in seconds
FLAGS = tiny(warmup_steps="0", seed=None, steps="3", timeout_s="10")

# Rank 1's rewards: the pre-training evals call the reward twice, the rollout of step 1 once; the
# 4th call (step 2's rollout) raises as a user's reward does, or hangs.
FAULTY = '''
import os, signal, sys, time
from gradnorm.dist import state
from gradnorm.tasks import repeat
from gradnorm.tasks.rewards import call_reward
from gradnorm.train import main

honest, calls = repeat.RepeatTask.reward, []

def user_score(response, answer):
    raise ValueError("my reward server is down")

def reward(self, response_ids, answers):
    calls.append(None)
    if os.environ["RANK"] == "1" and len(calls) == 4:
        if os.environ["FAULT"] == "raise":
            call_reward(user_score, "response", "a", 0)
        if os.environ["FAULT"] == "hang":
            time.sleep(600)
    return honest(self, response_ids, answers)

honest_write = state.write

def write(tensors, path):  # the checkpoint's writer (DCP), on every rank at once
    if os.environ["RANK"] == "1" and os.environ["FAULT"] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return honest_write(tensors, path)

repeat.RepeatTask.reward = reward
state.write = write
sys.exit(main())
'''


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    base = tmp_path_factory.mktemp("rank_failures")
    (base / "faulty.py").write_text(FAULTY)
    procs = {}
    for fault in ("raise", "hang", "die"):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT": fault, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = torchrun_command(2, *FLAGS, "--output-dir", str(base / fault), script=base / "faulty.py")
        if fault == "die":  # torchrun looks at its workers every 5 s, not 0.1 s: rank 0 finds the death first
            cmd.insert(cmd.index("--standalone"), "--monitor-interval=5")  # (else its SIGTERM races rank 0's line)
        procs[fault] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
    return {fault: (proc, *proc.communicate(timeout=300)) for fault, proc in procs.items()}


COVERAGE_AT_EXIT = re.compile(
    r"^Exception ignored in atexit callback: <bound method Coverage\._atexit[^\n]*\n"
    r"(?:(?:Traceback \(most recent call last\):|[ \t][^\n]*|During handling[^\n]*|The above exception[^\n]*|)\n)*"
    r"[^\n]*\n", re.M)
"""The test suite's own noise, not the trainer's: coverage (``[tool.coverage.run]``, which traces every
worker) saves a worker's data inside its ``os._exit``; when torchrun's SIGTERM to the survivors lands
during that save, coverage's SIGTERM handler saves again and prints this traceback. Without coverage
the worker has already left."""


def without_coverage_noise(stderr: str) -> str:
    return COVERAGE_AT_EXIT.sub("", stderr)


def test_the_coverage_filter_removes_coverage_s_traceback_and_nothing_else():
    noise = ("Exception ignored in atexit callback: <bound method Coverage._atexit of <Coverage @0x1>>\n"
             "Traceback (most recent call last):\n  File \"x.py\", line 1, in save\n    self.save()\n"
             "coverage.exceptions.DataError: Couldn't use data file 'd': no such table: context\n")
    ours = "error: step 3: rank 1 died\nTraceback (most recent call last):\n  File \"y\"\nValueError: boom\n"
    assert without_coverage_noise(ours + noise + "done\n") == ours + "done\n"
    assert without_coverage_noise(ours) == ours  # control: a traceback of anyone else stays


def workers_lines(stderr: str) -> list[str]:
    """stderr without torchrun's own report (its lines and its ChildFailedError traceback)."""
    lines = stderr.splitlines()
    if any(line.startswith("Traceback") and "torch/distributed/run.py" in stderr for line in lines):
        lines = lines[:next(i for i, line in enumerate(lines) if line.startswith("Traceback"))]
    return [line for line in lines if not line.startswith(("W", "E", "I")) or line.startswith("error: ")]


@pytest.mark.slow
@pytest.mark.parametrize("fault, says", [
    ("raise", "error: rank 1: step 2: reward function __main__:user_score raised ValueError('my reward server is "
              "down') on sequence 0 (answer 'a')"),
    ("hang", "error: step 2: rank 1 stopped responding after 10 s (--timeout-s) in a collective (Timed out waiting"),
    ("die", "error: step 3: rank 1 died or left the process group ("),
])
def test_a_failure_on_rank_1_is_rank_0s_one_line_and_no_rank_prints_a_traceback(fault, says, launches):
    proc, out, err = launches[fault]
    err = without_coverage_noise(err)
    assert proc.returncode != 0, err
    mine = workers_lines(err)
    errors = [line for line in mine if line.startswith("error: ")]
    assert errors and errors[0].startswith(says), err
    assert len(errors) == 1, err
    # Only torchrun's own ChildFailedError report may hold a traceback, after every worker has ended.
    assert "Traceback" not in "\n".join(mine), err
    assert err.count("Traceback") <= 1 and "RuntimeError" not in err and "gloo/transport" not in err, err


@pytest.mark.parametrize("message, peer", [
    # what gloo raises on rank 0 when rank 1 is stopped (SIGSTOP) inside a checkpoint's collective
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation", True),
    ("Application timeout caused pair closure", True),
    ("Connection reset by peer", True),
    ("CUDA error: an illegal memory access was encountered", False),  # the control: a failure of this rank's own
    ("shape '[2, 3]' is invalid for input of size 7", False),
])
def test_a_collective_that_failed_because_of_a_peer_is_told_from_a_failure_of_this_rank(message, peer):
    """Before, a rank SIGSTOPped during a save left rank 0 with a traceback: "Application timeout caused pair
    closure" was not among the peer failures, so the error was taken for rank 0's own."""
    from gradnorm.dist.comm import is_collective_failure

    assert is_collective_failure(RuntimeError(message)) is peer
