"""A start every rank agrees on (issue 54, "restarts where ranks disagree"): every rank joins the
process group first, the ranks agree on their own checks, and rank 0 alone decides what output-dir
holds while the others learn its decision (gradnorm/trainer/session.py). Before any step exists a
signal ends the process at once (``preemption.exit_at_once``).

Each test is a finding of the issue, with real processes (torchrun, a late rank, a real signal):
- an elastic restart whose rank 1 starts late once rank 0 has set the dead attempt's files aside;
- ``--overwrite`` where one rank fails its own check (its prompts file missing on its "node");
- a stale launcher environment (an sbatch script's RANK, WORLD_SIZE, SLURM_PROCID without srun);
- a rank left waiting for rank 0 (a torn journal rank 0 refuses) and torchrun's SIGTERM.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.fakes import fake_checkpoint, fake_model
from tests.helpers.runfiles import metrics
from tests.helpers.trainer import tiny

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "rank_script.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.launch


def torchrun(*args: str, restarts: int = 0) -> list[str]:
    """torchrun of 2 ranks of tests/helpers/rank_script.py (gradnorm/train.py after the test's per-rank twist)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", str(SCRIPT), *args]


def run(command: list[str], env: dict, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def the_error_line(stderr: str, says: str) -> str:
    """The workers' one ``error:`` line, which says ``says``, and no traceback through gradnorm (torchrun's
    own traceback of a failed worker, through torch/distributed, is its way of saying "exit code 2")."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0], stderr
    assert not [line for line in stderr.splitlines() if line.lstrip().startswith("File ") and "gradnorm" in line], stderr
    return errors[0]


def killed_by_sigkill(torchrun_output: str) -> bool:
    """Whether torchrun had to SIGKILL a worker that ignored its SIGTERM (its failure table says "Signal 9")."""
    return "Signal 9 (SIGKILL)" in torchrun_output or "exitcode  : -9" in torchrun_output


@pytest.mark.slow
def test_an_elastic_restart_with_a_late_rank_continues(tmp_path):
    """Finding: under ``torchrun --max-restarts ... --auto-resume`` a rank killed before the first
    checkpoint (once step 1 is logged, so the attempt's files are kept); on the restart rank 1
    starts 2 s after rank 0. Rank 0 set the dead attempt's files
    aside into previous_run/ and rank 1 then found "files of a run (previous_run) but no config.json"
    and refused, every restart after it too. Now rank 1 never reads output-dir: it learns rank 0's
    decision, and the restarted run finishes."""
    out, log = tmp_path / "run", tmp_path / "starts.log"
    env = {**ENV, "GRADNORM_TEST_KILL_WHEN": str(out / "metrics.jsonl"), "GRADNORM_TEST_LATE_1": "2",
           "GRADNORM_TEST_LATE_ON": "restart", "GRADNORM_TEST_LOG": str(log)}
    done = run(torchrun(*tiny(save_every="5"), "--steps", "6", "--output-dir", str(out), "--auto-resume",
                        restarts=1), env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert log.read_text().splitlines().count("attempt 1 rank 1") == 1, log.read_text()  # it was restarted, late
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5, 6]  # started over, every step once
    assert not (out / "previous_run").exists() and not (out / ".lock").exists()
    assert "no config.json" not in output


@pytest.mark.slow
def test_overwrite_moves_nothing_when_another_rank_fails_its_check(tmp_path):
    """Finding: ``--overwrite`` under torchrun where one rank's prompts file is missing on its node:
    rank 0 had already set the old run aside, then ignored torchrun's SIGTERM in the rendezvous for
    30 s, leaving the old run in previous_run/ with a stale lock. Now every rank checks first and the
    ranks agree: rank 1's line is the job's, and nothing of the old run moves."""
    out = tmp_path / "run"  # an old run: its marker, records and a checkpoint (what --overwrite sets aside)
    out.mkdir()
    (out / ".gradnorm-run").write_text("{}\n")
    (out / "config.json").write_text(json.dumps({"history": [{"step": 2}]}))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    fake_checkpoint(out, "ckpt_step2")
    before = sorted(p.name for p in out.iterdir())
    model = tmp_path / "model"
    fake_model(model)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    (node0 / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    env = {**ENV, "GRADNORM_TEST_CWD_0": str(node0), "GRADNORM_TEST_CWD_1": str(node1)}
    failed = run(torchrun("--model", str(model), "--prompts", "prompts.jsonl", "--steps", "2", "--no-plot",
                          "--output-dir", str(out), "--overwrite"), env)
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0
    line = the_error_line(failed.stderr, says="rank 1: --prompts")
    assert "prompts.jsonl" in line, line
    assert not killed_by_sigkill(output), output[-3000:]  # every rank ended by itself, none held torchrun's SIGTERM
    assert sorted(p.name for p in out.iterdir()) == before  # the old run in place: nothing set aside, no lock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_stale_launcher_environment_says_what_it_waits_for_and_a_signal_ends_it(tmp_path):
    """Finding: an sbatch script that runs python without srun leaves RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT and SLURM_PROCID: the process was accepted as launched, took the lock, then waited in
    the rendezvous for --timeout-s printing nothing, and ignored SIGTERM there. Now it says at once
    what it waits for, has written nothing, and a SIGTERM ends it with 143."""
    out = tmp_path / "run"
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "SLURM_PROCID": "0", "LOCAL_RANK": "0"}
    job = subprocess.Popen([sys.executable, "gradnorm/train.py", *tiny(), "--output-dir", str(out)], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        deadline = time.monotonic() + 120
        while "waiting for all 2 ranks" not in said:
            assert job.poll() is None and time.monotonic() < deadline, said
            said += job.stderr.readline()
        assert "127.0.0.1" in said and "leftover of another launch" in said, said
        assert not out.exists()  # nothing taken while it waits: no directory, no lock
        job.send_signal(signal.SIGTERM)
        _, rest = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 143, said + rest
    assert "received SIGTERM before training started" in rest, rest
    assert "Traceback" not in rest


@pytest.mark.slow
def test_a_rank_waiting_for_rank_0_ends_with_torchruns_sigterm(tmp_path):
    """Finding: a rank waiting in ``settle`` for the journal of an interrupted move ignored torchrun's
    SIGTERM once rank 0 had refused (a torn journal, bad input): torchrun SIGKILLed it 30 s later.
    Now no rank waits on output-dir (rank 0 decides, the others learn it) and a signal before
    training ends the process at once: every rank ends by itself."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".overwrite-journal.json").write_text('{"move": "aside", "names": ["config.js')  # torn by a crash
    late = {**ENV, "GRADNORM_TEST_LATE_0": "3"}  # rank 1 is already waiting when rank 0 refuses
    done = run(torchrun(*tiny(), "--steps", "2", "--output-dir", str(out)), late)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    the_error_line(done.stderr, says=".overwrite-journal.json is unreadable")
    assert not killed_by_sigkill(output), output[-3000:]
