"""Preemption: SIGTERM and SIGINT finish the step, checkpoint, exit with 143 or 130, and lose nothing.

What must hold (gradnorm/trainer/guards/preemption.py; the trainer's use of it is four lines in train.py):
- a signal inside ``catch_signals`` only records a request (no KeyboardInterrupt, the process goes
  on); the handlers before it are back afterwards; ``agreed`` picks the same signal on every rank;
- a second signal exits at once (143, one line) even while the main thread is blocked in C++
  inside torch.distributed, where a Python-level handler would never run; a copy of the first
  within ``DUPLICATE_S`` is the same request;
- ``python gradnorm/train.py`` and Ctrl-C (SIGINT): exit 130, one line, no traceback, a
  checkpoint at the step it stopped after, and ``--resume`` logs what an uninterrupted run logs;
- ``torchrun --nproc_per_node=2``, SIGTERM to the torchrun agent (which forwards it to every
  worker) or to ONE worker only: every rank stops after the same step (the vote rides on the
  logging all-reduce), one checkpoint of that step, and ``--resume`` matches an uninterrupted run.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.helpers.faults import rank_1_worker
from tests.helpers.runfiles import comparable, metrics
from tests.helpers.trainer import tiny, torchrun_cmd

from gradnorm.train import main
from gradnorm.trainer.checkpoint import store
from gradnorm.trainer.guards import preemption

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# TINY with 4 prompts x 4 completions, 4 eval prompts and a 1-layer model of width 32 (the default
# head count) on seed 5: the runs this module's signals interrupt have always used these values
FLAGS = tiny(prompts_per_step="4", group_size="4", eval_prompts="4", n_embd="32", n_head=None, seed="5")
STEPS = 120  # far more than the steps that pass before the signal lands; --save-every keeps its default 100


# ------------------------------------------------------------------ the module, in this process


def wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_signal_inside_the_block_is_a_request_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with preemption.catch_signals():
        assert preemption.requested() is None
        assert preemption.votes(torch.zeros(1)).tolist() == [0.0, 0.0]
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt in pytest without the block
        wait_for(lambda: preemption.requested() is not None)
        assert preemption.requested() == signal.SIGINT
        assert preemption.votes(torch.zeros(1)).tolist() == [1.0, 0.0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert preemption.requested() is None  # a later block starts clean


@pytest.mark.parametrize("summed, expected", [
    ([0.0, 0.0], None), ([1.0, 0.0], signal.SIGINT), ([0.0, 2.0], signal.SIGTERM), ([1.0, 1.0], signal.SIGTERM),
])
def test_the_summed_votes_give_every_rank_the_same_decision(summed, expected):
    assert preemption.agreed(torch.tensor(summed, dtype=torch.float64)) == expected


def test_stopped_names_the_signal_the_step_and_the_exit_code(tmp_path):
    stopped = preemption.Stopped(signal.SIGTERM, 7, tmp_path / "ckpt_step7")
    assert stopped.exit_code == 143 and preemption.Stopped(signal.SIGINT, 1, tmp_path).exit_code == 130
    assert str(stopped).startswith("stopped by SIGTERM after step 7: checkpoint ") and "--resume" in str(stopped)


BLOCKED = """
import datetime, os, signal, sys, time
import torch.distributed as dist
from gradnorm.trainer.guards import preemption
from gradnorm.dist.spawn import free_port
with preemption.catch_signals():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # a copy of the same stop, as SLURM + torchrun deliver it
    while preemption.requested() is None:
        time.sleep(0.01)
    print("requested", flush=True)
    # Blocked in C++ for up to 120 s: rank 0 of 2 waits for a rank 1 that never comes.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
print("not reached", flush=True)
"""


@pytest.mark.launch
def test_a_second_signal_exits_at_once_even_inside_a_blocking_collective():
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "requested\n"
        time.sleep(preemption.DUPLICATE_S + 1.0)  # the duplicate was sent long ago; the process lives on
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)  # far less than the 120 s the rendezvous would wait
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "not reached" not in out and "Traceback" not in err
    assert err.splitlines()[-1] == "received SIGTERM again: exiting at once, without a checkpoint (exit code 143)"


# ------------------------------------------------------------------ the trainer, signalled


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def signal_after_first_step(proc: subprocess.Popen, out: Path, pid_of_target, sig: int) -> tuple[str, str]:
    """Send ``sig`` to ``pid_of_target()`` once step 1 is logged; return the job's (stdout, stderr)."""
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 1"
            time.sleep(0.01)
        os.kill(pid_of_target(), sig)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def assert_stopped_cleanly(out: Path, stderr: str, signame: str) -> int:
    """One checkpoint directory, at the step the log stops at, complete and loadable; return that step."""
    rows = metrics(out)
    stopped_at = len(rows)
    assert 1 <= stopped_at < STEPS, f"the run finished before the signal took effect:\n{stderr}"
    assert [m["step"] for m in rows] == list(range(1, stopped_at + 1))
    ckpt = out / f"ckpt_step{stopped_at}"
    line = f"stopped by {signame} after step {stopped_at}: checkpoint {ckpt} written"
    assert [x for x in stderr.splitlines() if x.startswith("stopped by")] == [line + "; continue with --resume"]
    assert sorted(p.name for p in out.glob("*ckpt_step*")) == [ckpt.name]  # no other, and no torn .tmp directory
    assert store.read_run_state(ckpt, required=("step",))["step"] == stopped_at
    assert store.read_tensors(ckpt, "model")  # .metadata and the data files are complete
    return stopped_at


@pytest.mark.launch
def test_ctrl_c_on_plain_python_checkpoints_and_exits_130_without_a_traceback(tmp_path):
    stopped, full = tmp_path / "stopped", tmp_path / "full"
    cmd = [sys.executable, "gradnorm/train.py", *FLAGS, "--steps", str(STEPS)]
    proc = start([*cmd, "--output-dir", str(stopped)])
    _, err = signal_after_first_step(proc, stopped, lambda: proc.pid, signal.SIGINT)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert_stopped_cleanly(stopped, err, "SIGINT")
    resumed = subprocess.run([*cmd, "--output-dir", str(stopped), "--resume"], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert main([*FLAGS, "--steps", str(STEPS), "--output-dir", str(full)]) == 0  # uninterrupted, in this process
    assert comparable(stopped) == comparable(full)


def test_a_stop_during_a_reused_rollout_waits_for_its_last_update(tmp_path, monkeypatch, capsys):
    """U = 2 updates per rollout: a checkpoint between them could not be resumed exactly (the rollout is not saved)."""
    from gradnorm.trainer.logs import metrics

    honest = metrics.write_record

    def signal_at_step_2(metrics_file, bar, record, cfg):
        honest(metrics_file, bar, record, cfg)
        if record["step"] == 2:  # step 3 (the first update of the 2nd rollout) carries the vote
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(lambda: preemption.requested() is not None)

    flags = [*FLAGS, "--steps", "8", "--minibatches-per-rollout", "2"]
    stopped, full = tmp_path / "stopped", tmp_path / "full"
    monkeypatch.setattr(metrics, "write_record", signal_at_step_2)
    with preemption.catch_signals():
        assert main([*flags, "--output-dir", str(stopped)]) == 143
    assert assert_stopped_cleanly(stopped, capsys.readouterr().err, "SIGTERM") == 4
    monkeypatch.undo()
    assert main([*flags, "--output-dir", str(stopped), "--resume"]) == 0
    assert main([*flags, "--output-dir", str(full)]) == 0
    assert comparable(stopped) == comparable(full)


@pytest.mark.parametrize("steps", ["3", "1"])  # 1: the first chance is the last step too
def test_ctrl_c_right_after_an_accidental_overwrite_puts_the_old_run_back(tmp_path, capsys, steps):
    """Ctrl-C during the warm-up of an --overwrite run: before, the stop waited for step 1, whose
    checkpoint completed the overwrite and deleted the old run (with --steps 1 it also exited 0)."""
    out = tmp_path / "run"
    assert main([*FLAGS, "--steps", "2", "--output-dir", str(out)]) == 0
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    with preemption.catch_signals():
        os.kill(os.getpid(), signal.SIGINT)  # pressed as the new run starts, before its first GRPO step
        wait_for(lambda: preemption.requested() is not None)
        assert main([*FLAGS, "--steps", steps, "--seed", "5", "--save-every", "1", "--output-dir", str(out),
                     "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert "stopped by SIGINT after step 1, the first of this --overwrite run: no checkpoint written" in err, err
    assert "the previous run is back in" in err and "Traceback" not in err, err
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.launch
def test_ctrl_c_while_the_script_still_imports_torch_exits_130_without_a_traceback(tmp_path):
    proc = start([sys.executable, "gradnorm/train.py", *FLAGS, "--output-dir", str(tmp_path / "run")])
    try:
        maps = Path(f"/proc/{proc.pid}/maps")
        deadline = time.monotonic() + 60
        while "libtorch" not in maps.read_text():  # inside `import torch`, so past the script's first lines
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and err == "" and out == "", err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("preemption") / "full"
    proc = subprocess.run(torchrun_cmd(out, "--steps", str(STEPS), base=FLAGS), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def rank1_worker(agent_pid: int) -> int:
    psutil = pytest.importorskip("psutil")
    deadline = time.monotonic() + 60
    while (worker := rank_1_worker(psutil, agent_pid)) is None:
        assert time.monotonic() < deadline, "no worker with RANK=1"
        time.sleep(0.05)
    return worker.pid


@pytest.mark.slow
@pytest.mark.parametrize("target", ["torchrun agent", "one worker"])
def test_sigterm_under_torchrun_stops_every_rank_after_the_same_step_and_resume_loses_nothing(
        target, tmp_path, uninterrupted):
    out = tmp_path / "stopped"
    proc = start(torchrun_cmd(out, "--steps", str(STEPS), base=FLAGS))
    pid_of_target = (lambda: proc.pid) if target == "torchrun agent" else (lambda: rank1_worker(proc.pid))
    _, err = signal_after_first_step(proc, out, pid_of_target, signal.SIGTERM)
    # torchrun exits 1 either way: re-raising the SIGTERM it got, or reporting workers that exited 143.
    assert proc.returncode != 0, err
    if target == "one worker":
        assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", err)) == {"143"}, err  # every rank exited 143
    assert_stopped_cleanly(out, err, "SIGTERM")
    resumed = subprocess.run(torchrun_cmd(out, "--steps", str(STEPS), "--resume", base=FLAGS), cwd=ROOT, env=ENV, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(out) == comparable(uninterrupted)
