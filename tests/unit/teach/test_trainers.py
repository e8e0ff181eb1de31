"""gradnorm.teach.trainers against weights written out by hand on a four-row minibatch.

Rows of 3, 1, 2 and 4 counted tokens (N = 10) on W = 2 ranks: rank 0 holds rows 0 and 1 in one
microbatch (4 tokens), rank 1 rows 2 and 3 split in two microbatches (2 and 4 tokens). Each
microbatch's own mean gives 1/4, 1/4, 1/2 and 1/4 a token; the token mean 1/10 everywhere.
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from gradnorm.teach import trainers
from gradnorm.teach.palette import rank_color

LENGTHS = [3, 1, 2, 4]
MASK = torch.arange(5) < torch.tensor(LENGTHS)[:, None]  # (4, 5)
PLAN = [[torch.tensor([0, 1])], [torch.tensor([2]), torch.tensor([3])]]  # W = 2; A = 1 on rank 0, 2 on rank 1
N = sum(LENGTHS)
BY_HAND = np.zeros((4, 5))
BY_HAND[0, :3] = 1 / 4
BY_HAND[1, :1] = 1 / 4
BY_HAND[2, :2] = 1 / 2
BY_HAND[3, :4] = 1 / 4
TOKEN_MEAN = MASK.double() / N


def test_microbatch_mean_weights_are_one_over_each_microbatchs_count():
    np.testing.assert_allclose(trainers.microbatch_mean_weights(MASK, PLAN), BY_HAND, rtol=0, atol=1e-15)
    # control: with these ragged counts the token mean is not it
    assert not np.allclose(trainers.microbatch_mean_weights(MASK, PLAN), TOKEN_MEAN.numpy())


def test_step_size_is_the_number_of_microbatches_for_their_own_means_and_1_for_the_token_mean():
    bug = trainers.step_size(BY_HAND, TOKEN_MEAN, MASK, world_size=2, accum_steps=2)
    assert bug.total == pytest.approx(3.0) and bug.reference_total == pytest.approx(1.0)
    assert bug.scale == pytest.approx(3.0)  # three microbatches, each totalling 1
    fix = trainers.step_size(TOKEN_MEAN, TOKEN_MEAN, MASK, world_size=2, accum_steps=2)
    assert fix.scale == pytest.approx(1.0)


def test_step_size_counts_only_the_masked_tokens():
    leaking = BY_HAND.copy()
    leaking[1, 4] = 7.0  # weight on padding: not part of the counted total
    assert trainers.step_size(leaking, TOKEN_MEAN, MASK, 2, 2).total == pytest.approx(3.0)


def test_token_bars_follow_the_plan_and_their_area_is_the_total_weight():
    bars = trainers.token_bars(BY_HAND, MASK, PLAN)
    assert bars.width == pytest.approx(1 / N)
    np.testing.assert_allclose(bars.left, np.arange(N) / N)
    # plan order: row 0 (3 tokens), row 1 (1), then rank 1's row 2 (2) and row 3 (4); height w x N
    expected = [N / 4] * 3 + [N / 4] + [N / 2] * 2 + [N / 4] * 4
    np.testing.assert_allclose(bars.height, expected)
    assert bars.rank.tolist() == [0] * 4 + [1] * 6
    assert bars.microbatch.tolist() == [0] * 4 + [0] * 2 + [1] * 4
    assert bars.area == pytest.approx(BY_HAND.sum())
    assert trainers.token_bars(TOKEN_MEAN, MASK, PLAN).area == pytest.approx(1.0)


def test_token_bars_refuse_a_plan_that_misses_a_row():
    with pytest.raises(ValueError, match="holds 6 counted tokens, the mask 10"):
        trainers.token_bars(BY_HAND, MASK, [[torch.tensor([0, 1])], [torch.tensor([2])]])


def test_plot_token_weights_draws_the_bars_it_computes():
    fig, ax = plt.subplots()
    drawn = trainers.plot_token_weights(ax, BY_HAND, MASK, PLAN, title="by hand")
    bars = trainers.token_bars(BY_HAND, MASK, PLAN)
    np.testing.assert_allclose([p.get_height() for p in drawn], bars.height)
    np.testing.assert_allclose([p.get_width() for p in drawn], bars.width)
    assert [matplotlib.colors.to_hex(p.get_facecolor()) for p in drawn] == [rank_color(r) for r in bars.rank]
    # one solid line between the ranks, one dotted line between rank 1's microbatches
    styles = sorted(line.get_linestyle() for line in ax.lines if line.get_xdata()[0] == line.get_xdata()[1]
                    and line.get_xdata()[0] in (bars.left[4], bars.left[6]))
    assert styles == ["-", ":"]
    assert "total weight (bar area) 3" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["1/N, the token mean", "rank 0", "rank 1"]
    plt.close(fig)


def test_example_build_finds_the_repositorys_build_functions_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = trainers.example_build("hf_trainer.py:build_dropping")
    file, function = spec.rsplit(":", 1)
    assert function == "build_dropping" and "def build_dropping(" in open(file).read()
    with pytest.raises(ValueError, match="expected 'file.py:function'"):
        trainers.example_build("no_such_trainer.py:build")  # the control: a missing file is refused
