"""The phase timer: laps charge the time between them to a phase, and a step's phases add up to it.

A fake clock makes the unit checks exact. A tiny in-process run of the trainer (main(), one
process, 3 steps) checks that every line of metrics.jsonl has every phase, that the phases of a
step add up to its wall time (the difference of consecutive ``elapsed_s``), and that a checkpoint
lands in the line after its step. The 2-rank checks (the max over ranks) extend the torchrun run
of tests/e2e/test_train_e2e.py.
"""

import json

import pytest
import torch

from gradnorm.train import main
from gradnorm.trainer.logs import phases
from gradnorm.trainer.logs.metrics import TIMING_KEYS


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_laps_charge_the_time_since_the_previous_lap_and_add_up_to_the_step():
    clock = FakeClock()
    timer = phases.PhaseTimer("cpu", clock=clock)
    start = timer.last
    for phase, seconds in [("rollout", 2.0), ("counts", 0.25), ("forward_backward", 1.0), ("rollout", 0.5),
                           ("optimizer", 0.125)]:
        clock.now += seconds
        timer.lap(phase)
    assert timer.peek("rollout") == 2.5  # two laps of one phase add up
    seen = []
    times = timer.split(lambda t: seen.append(t.clone()) or t * 2)  # a stand-in for the MAX all-reduce
    assert set(times) == set(phases.METRIC_KEYS)
    assert times["time_rollout_s"] == 2.5 and times["time_counts_s"] == 0.25 and times["time_scoring_s"] == 0.0
    assert sum(times[f"time_{p}_s"] for p in phases.PHASES) == clock.now - start == 3.875
    # what the all-reduce got is rank 0's vector of the max phases; what it returned is logged as *_max_s
    assert seen[0].tolist() == [2.5, 0.0, 1.0] and seen[0].dtype == torch.float64
    assert [times[f"time_{p}_max_s"] for p in phases.MAX_PHASES] == [5.0, 0.0, 2.0]
    # split starts the next step from zero, its clock where this one ended
    clock.now += 1.0
    timer.lap("checkpoint")
    assert timer.split()["time_checkpoint_s"] == 1.0 and timer.peek("rollout") == 0.0


def test_a_misspelt_phase_is_an_error_not_a_new_key():
    with pytest.raises(KeyError):
        phases.PhaseTimer().lap("forward")


def test_every_phase_is_a_timing_key_so_determinism_checks_ignore_it():
    assert set(phases.METRIC_KEYS) <= set(TIMING_KEYS)


def test_a_tiny_run_logs_every_phase_and_the_phases_of_a_step_add_up_to_its_wall_time(tmp_path):
    out = tmp_path / "run"
    assert main(["--steps", "3", "--save-every", "2", "--prompts-per-step", "2", "--group-size", "2",
                 "--warmup-steps", "0", "--eval-prompts", "2", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                 "--no-plot", "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    previous = 0.0
    for r in rows:
        assert set(phases.METRIC_KEYS) <= set(r), r
        assert all(r[k] >= 0 for k in phases.METRIC_KEYS), r
        step_time = sum(r[f"time_{p}_s"] for p in phases.PHASES)
        assert step_time == pytest.approx(r["elapsed_s"] - previous, rel=1e-9, abs=1e-9)
        assert r["time_rollout_s"] > 0 and r["time_forward_backward_s"] > 0  # both really ran every step
        for p in phases.MAX_PHASES:  # one process: the max over ranks is its own time
            assert r[f"time_{p}_max_s"] == r[f"time_{p}_s"]
        previous = r["elapsed_s"]
    assert rows[0]["time_log_s"] == rows[0]["time_checkpoint_s"] == 0.0  # nothing came before step 1
    assert rows[1]["time_log_s"] > 0  # step 1's line was written within step 2's time
