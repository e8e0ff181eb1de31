"""The statistics of the controlled study (``benchmarks/study.py``), against longhand references on
made-up numbers; no training here. The single-process stand-in for 2 ranks x 2 microbatches is
checked too, with its control: a sharding that deals rows differently must break it.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradnorm.teach import study as st
from gradnorm.teach.study import bootstrap_ci, paired_difference, steps_to_threshold

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
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


def _tiny_study():
    flags = ["--task", "bimodal", "--loss-denominator", "local", "--shard", "length", "--grad-accum-steps", "4",
             "--steps", "60", "--prompts-per-step", "8", "--max-new-tokens", "20", "--seed", "0", "--no-plot",
             "--log-every", "60"]
    runs = [{"flags": flags, "seed": s, "reward_curve": [0.1 * s] * 12, "length_curve": [10.0, 14.0]} for s in range(5)]
    iv = {"mean": 0.1, "lo": 0.02, "hi": 0.2}
    return {"meta": {"seeds": list(range(5))}, "tasks": ["bimodal"],
            "cells": [{"task": "bimodal", "mode": "local", "shard": "length", "clip": True, "runs": runs}],
            "comparisons": [{"task": "bimodal", "cell": "bimodal/local/length", "against": "bimodal/token/length",
                             "seeds": [0, 1], "final_reward": iv, "steps_to_threshold": {"mean": -2.0, "lo": -4.0, "hi": -1.0},
                             "eval_reward_13-16": {"mean": 0.0, "lo": -0.1, "hi": 0.1}}]}


def test_resolved_differences_keep_either_direction_and_list_the_rest():
    yes, no = st.resolved_differences(_tiny_study())
    assert [(r[2], r[3].mean) for r in yes] == [("final_reward", 0.1), ("steps_to_threshold", -2.0)]
    assert [r[2] for r in no] == ["eval_reward_13-16"]


def test_band_exits_count_a_held_out_seed_outside_the_others_range():
    curves = np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])  # the two extremes leave, the middle two do not
    assert st.band_exits(curves) == {"any": 0.5, "steps": 0.5}
    crossing = np.array([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]])  # each extreme at one step
    assert st.band_exits(crossing)["any"] == 2 / 3 and st.band_exits(crossing, steps=1)["steps"] == 2 / 3
    assert st.study_band_exits(_tiny_study(), window=3)["any"] == 0.4  # seeds 0 and 4 of 5


def test_mean_n_over_c_is_mean_length_over_max_new_tokens():
    assert st.mean_n_over_c(_tiny_study()["cells"][0]["runs"], 20) == 0.6


def test_live_settings_take_the_study_flags_and_name_what_differs():
    s = st.live_settings(_tiny_study(), "bimodal", "local", "length", seed=5, steps=40, prompts=8)
    kw = s["kwargs"]
    assert kw["loss_denominator"] == "local" and kw["grad_accum_steps"] == 4 and kw["steps"] == 40 and kw["seed"] == 5
    assert kw["extra_args"] == ["--task", "bimodal", "--prompts-per-step", "8", "--max-new-tokens", "20", "--no-plot",
                                "--log-every", "40"]
    assert s["differs"] == [("--steps", "60", "40"), ("--seed", "0", "5"), ("--log-every", "60", "40")]
    study = _tiny_study()
    study["cells"][0]["mode"] = "token"  # a number C the study did not run takes token's flags
    number = st.live_settings(study, "bimodal", "640", "length", seed=0, steps=60, prompts=8)
    assert number["kwargs"]["loss_denominator"] == "640" and number["differs"][0] == ("--loss-denominator", "local", "640")


def test_effect_grid_draws_one_forest_per_measure_and_task():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, squeeze=False)
    st.plot_effect_grid(axes, _tiny_study(), ["final_reward", "eval_reward_1-4"])
    assert [t.get_text() for t in axes[0][0].get_yticklabels()] == ["local/length - token"]
    assert not axes[1][0].axison  # the measure is not in the study
    plt.close(fig)


def test_effect_panels_of_different_tasks_share_their_rows_and_keep_zero_off_the_edge():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    study = _tiny_study()
    study["tasks"] = ["bimodal", "repeat"]
    repeat = dict(study["comparisons"][0], task="repeat", cell="repeat/local/length", against="repeat/token/length",
                  final_reward={"mean": 0.3, "lo": 0.0, "hi": 0.5})  # an interval that starts at zero
    study["comparisons"].append(dict(repeat))
    study["comparisons"][0] = dict(study["comparisons"][0], cell="bimodal/local/length/noclip",
                                   against="bimodal/token/length/noclip")
    study["comparisons"].insert(0, dict(study["comparisons"][0], cell="bimodal/local/length",
                                        against="bimodal/token/length"))
    fig, axes = plt.subplots(1, 2, squeeze=False)
    st.plot_effect_grid(axes, study, ["final_reward"])
    labels = [[t.get_text() for t in ax.get_yticklabels()] for ax in axes[0]]
    assert labels[0] == labels[1] == ["local/length - token", "local/length/noclip - token/noclip"]
    assert len(axes[0][1].lines) == 2 + 1  # repeat: one row drawn (bar and dot), the other blank; the zero line
    lo, hi = axes[0][1].get_xlim()
    assert lo < 0.0 < hi  # zero is inside the axis, not on its edge
    plt.close(fig)


def test_t_distribution_against_closed_forms():
    import math
    for t in (0.3, 1.0, 4.0, 30.0):
        assert st.t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-9)  # Cauchy
        assert st.t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-9)
    assert st.t_two_sided_p(0.0, 4) == 1.0 and st.t_two_sided_p(-1.0, 1) == st.t_two_sided_p(1.0, 1)
    assert st.t_quantile(0.95, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-7)
    assert st.t_quantile(0.95, 4) == pytest.approx(2.7764451, abs=1e-6)  # the tables' value
    assert st.t_quantile(0.95, 200) == pytest.approx(1.9719, abs=1e-4)  # the tables' value, near the normal's 1.96


def test_t_interval_and_paired_p_longhand():
    x = [0.1, 0.4, 0.2, 0.5, 0.3]
    se = np.std(x, ddof=1) / np.sqrt(5)  # 0.0707...
    iv = st.t_interval(x)
    assert iv.mean == pytest.approx(0.3) and iv.hi - iv.mean == pytest.approx(2.7764451 * se, rel=1e-6)
    assert st.paired_t_p(x) == pytest.approx(st.t_two_sided_p(0.3 / se, 4))
    assert st.paired_t_p([0.2] * 5) == 0.0 and st.paired_t_p([0.0] * 5) == 1.0
    with pytest.raises(ValueError):
        st.t_interval([1.0])


def test_holm_steps_down_and_stops_at_the_first_failure():
    # m = 4, thresholds .05/4, .05/3, .05/2, .05/1 = .0125, .0167, .025, .05 for the sorted
    # p .001, .01, .03, .04: the first two pass, .03 > .025 fails and stops the rest
    assert st.holm([0.01, 0.04, 0.03, 0.001]) == [True, False, False, True]
    assert st.holm([0.03, 0.001, 0.04]) == [False, True, False]  # .04 < .05 would pass alone, but is not reached
    assert st.holm([0.01, 0.015, 0.03, 0.001]) == [True] * 4
    assert st.holm([0.04]) == [True] and st.holm([0.06]) == [False]
    uncorrected = [p < 0.05 for p in (0.01, 0.04, 0.03, 0.001)]
    assert uncorrected != st.holm([0.01, 0.04, 0.03, 0.001])  # control: the correction changes the answer


def test_a_null_of_five_seeds_shows_the_bootstrap_too_narrow_and_the_t_interval_not():
    rates = st.null_exclusion_rate(5, trials=600)
    assert abs(rates["t"] - 0.05) < 0.03  # the t interval holds its 95%
    assert rates["bootstrap"] > 0.1  # the percentile bootstrap of 5 values does not


def test_seed_differences_reproduce_the_committed_study_intervals():
    study = st.load_study()
    tested = st.tested_differences(study)
    assert len(tested) == len(st.differences(study)) and sum(r.main for r in tested) == 1
    for r in tested:
        again = st.paired_difference(st.seed_differences(study, r.cell, r.key), np.zeros(len(study["meta"]["seeds"])))
        assert again == r.bootstrap, (r.cell, r.key)
    broken = json_copy(study)
    broken["cells"][0]["runs"][0]["final_reward"] += 1.0  # control: a changed run changes the recomputation
    cell = f"{broken['cells'][0]['task']}/{broken['cells'][0]['mode']}/{broken['cells'][0]['shard']}"
    assert not np.array_equal(st.seed_differences(broken, cell, "final_reward"),
                              st.seed_differences(study, cell, "final_reward"))


def json_copy(x):
    import json
    return json.loads(json.dumps(x))


@pytest.mark.launch
def test_the_committed_study_comes_from_a_clean_commit_of_this_repository():
    """The provenance study.py records: a commit, without "uncommitted changes", reachable from HEAD
    (a study from a dirty tree or another branch cannot be rerun to the same numbers)."""
    import json
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[3]
    meta = json.loads((root / "benchmarks" / "study.json").read_text())["meta"]
    assert "uncommitted" not in meta["commit"], meta["commit"]
    assert meta["command"].startswith("python benchmarks/study.py --out benchmarks"), meta["command"]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout: the commit cannot be looked up")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=root, capture_output=True, text=True)
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone: older commits are not here to look up")
    found = subprocess.run(["git", "merge-base", "--is-ancestor", meta["commit"], "HEAD"], cwd=root)
    assert found.returncode == 0, f"study.json names commit {meta['commit']}, which is not an ancestor of HEAD"
