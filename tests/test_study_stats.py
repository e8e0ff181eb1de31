"""The statistics of the controlled study (``benchmarks/study.py``), against longhand references on
made-up numbers; no training here. The single-process stand-in for 2 ranks x 2 microbatches is
checked too, with its control: a sharding that deals rows differently must break it.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradnorm.teach.study import bootstrap_ci, paired_difference, steps_to_threshold

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import study  # noqa: E402


def test_steps_to_threshold_is_the_first_step_whose_trailing_mean_reaches_it():
    rewards = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    # trailing means over 2 steps, longhand: 0, .1, .3, .5, .7, .9, 1
    assert steps_to_threshold(rewards, 0.45, window=2) == 4
    assert steps_to_threshold(rewards, 0.85, window=2) == 6
    assert steps_to_threshold(rewards, 0.0, window=2) == 1
    assert steps_to_threshold(rewards, 1.01, window=2) is None  # never reached: censored
    assert steps_to_threshold(rewards, 0.5, window=1) == 4  # window 1: the raw reward, 0.6 at step 4


def test_bootstrap_interval_resamples_seeds_and_is_reproducible():
    values = [0.1, 0.4, 0.2, 0.5, 0.3]
    iv = bootstrap_ci(values, n_resamples=4000, seed=3)
    assert iv.mean == pytest.approx(0.3)
    rng = np.random.default_rng(3)  # the longhand resampling
    means = np.array(values)[rng.integers(0, 5, size=(4000, 5))].mean(1)
    assert (iv.lo, iv.hi) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))
    assert iv.lo < iv.mean < iv.hi and min(values) <= iv.lo and iv.hi <= max(values)
    assert bootstrap_ci(values, n_resamples=4000, seed=3) == iv
    same = bootstrap_ci([0.7] * 5)
    assert same.lo == same.hi == same.mean == pytest.approx(0.7)
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, float("nan")])


def test_paired_difference_cancels_what_a_seed_shares():
    seed_effect = np.array([0.1, 0.5, 0.9, 0.3, 0.7])  # large spread between seeds
    a, b = seed_effect + 0.05, seed_effect
    d = paired_difference(a, b)
    assert d.mean == pytest.approx(0.05) and d.lo == pytest.approx(0.05) and d.hi == pytest.approx(0.05)
    assert d.excludes_zero()
    unpaired = bootstrap_ci(a).mean - bootstrap_ci(b).mean  # same point estimate,
    assert unpaired == pytest.approx(d.mean)
    assert not paired_difference(b[::-1], b).excludes_zero()  # control: shuffled pairs carry no effect
    with pytest.raises(ValueError):
        paired_difference([1.0, 2.0], [1.0])


def test_one_process_with_four_microbatches_weighs_tokens_as_two_ranks_with_two():
    lengths = torch.randint(1, 21, (64,), generator=torch.Generator().manual_seed(0))
    study.check_single_process(lengths, group_size=8, sequences_c=64 * 20.0)  # raises if any mode differs


def test_study_cells_cover_the_modes_shardings_and_a_clip_off_column():
    cells = study.cells()
    for task in study.TASKS:
        here = [c for c in cells if c["task"] == task]
        assert {c["mode"] for c in here if c["shard"] == "length" and c["clip"]} == set(study.MODES)
        assert any(c["shard"] == "balanced" for c in here)
    assert any(not c["clip"] for c in cells)
    assert study.denominator_flag("constant", 128, 20) == "2560" and study.denominator_flag("group", 128, 20) == "group"
