"""Token imbalance without a model (``gradnorm.teach.imbalance``), against values worked out by hand.

Each view comes with a control that must fail: ``local`` must differ from ``token`` when
microbatch token counts are ragged and agree with it when they are balanced, so a test that cannot
fail would show.
"""

from fractions import Fraction

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from gradnorm.teach import imbalance
from gradnorm.core.denominators import mask_from_lengths
from gradnorm.core.sharding import make_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def fractions(weights):
    return [Fraction(float(w)).limit_denominator(10_000) for w in weights]


def test_imbalanced_minibatch_layout():
    batch = imbalance.imbalanced_minibatch(world_size=2, accum_steps=2, imbalance=4, seqs_per_microbatch=2,
                                          full_length=12)
    assert batch.lengths.tolist() == [3, 3, 12, 12, 12, 12, 12, 12]
    assert batch.microbatch_tokens().tolist() == [[6, 24], [24, 24]]
    assert (batch.world_size, batch.accum_steps, batch.num_groups) == (2, 2, 4)
    with pytest.raises(ValueError):
        imbalance.imbalanced_minibatch(imbalance=0.5)


def test_token_layout_by_hand():
    # N = 78 tokens; local: w = 1 / (W * A * N[r, m]) = 1/24 in the 6-token microbatch, 1/96 elsewhere.
    batch = imbalance.imbalanced_minibatch(2, 2, 4, full_length=12)
    local = imbalance.token_layout(batch, "local")
    assert fractions(local.weight) == [Fraction(1, 24)] * 2 + [Fraction(1, 96)] * 6
    assert local.rank.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert local.microbatch.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert local.left.tolist() == [0, 3, 6, 18, 30, 42, 54, 66]
    assert imbalance.weight_ratio(local) == pytest.approx(4.0)
    token = imbalance.token_layout(batch, "token")
    assert fractions(token.weight) == [Fraction(1, 78)] * 8
    assert imbalance.weight_ratio(token) == pytest.approx(1.0)
    assert token.total.sum() == pytest.approx(1.0)


def test_rank_shares_by_hand_and_the_control():
    batch = imbalance.imbalanced_minibatch(2, 2, 4, full_length=12)
    local = imbalance.batch_rank_shares(batch, "local")
    token = imbalance.batch_rank_shares(batch, "token")
    assert_allclose(local.tokens, [30 / 78, 48 / 78])
    assert_allclose(local.update, [0.5, 0.5])  # every rank gets 1/W under local
    assert_allclose(token.update, token.tokens)  # the fix: the update follows the tokens
    assert not np.allclose(local.update, local.tokens)  # control: ragged counts must show
    balanced = imbalance.imbalanced_minibatch(2, 2, 1, full_length=12)
    assert_allclose(imbalance.batch_rank_shares(balanced, "local").update, [0.5, 0.5])
    assert_allclose(imbalance.batch_rank_shares(balanced, "local").update,
                    imbalance.batch_rank_shares(balanced, "token").update)


def test_worked_example_numbers():
    batch = imbalance.worked_example_minibatch()
    assert batch.microbatch_tokens().tolist() == [[3, 14], [12, 12]]
    local = imbalance.token_layout(batch, "local")
    assert fractions(local.weight) == [Fraction(1, 12)] * 2 + [Fraction(1, 56)] * 2 + [Fraction(1, 48)] * 4
    assert_allclose(imbalance.batch_rank_shares(batch, "local").update, [0.5, 0.5])
    assert_allclose(imbalance.batch_rank_shares(batch, "token").update, [17 / 41, 24 / 41])


def test_rank_shares_of_a_constant_are_token_shares_even_though_weights_sum_below_one():
    batch = imbalance.worked_example_minibatch()
    shares = imbalance.rank_shares(batch.mask, batch.group_ids, batch.num_groups, 48.0, batch.plan)
    assert_allclose(shares.update, [17 / 41, 24 / 41])


def test_rank_shares_with_an_empty_rank():
    lengths = torch.tensor([0, 0, 5, 7])
    plan = make_plan("contiguous", lengths, 2, 1)
    shares = imbalance.rank_shares(mask_from_lengths(lengths), torch.tensor([0, 0, 1, 1]), 2, "token", plan)
    assert_allclose(shares.tokens, [0, 1])
    assert_allclose(shares.update, [0, 1])


def test_share_sweep():
    sweep = imbalance.share_sweep([1, 2, 4], world_size=2, accum_steps=2, full_length=12)
    assert_allclose(sweep.update_share["local"], [0.5, 0.5, 0.5])
    # rank 0 holds 2 * 12 / imbalance + 24 of 2 * 12 / imbalance + 72 tokens
    assert_allclose(sweep.token_share, [48 / 96, 36 / 84, 30 / 78])
    assert_allclose(sweep.update_share["token"], sweep.token_share)


def test_the_imbalance_figure_of_pairs_and_of_label_tokens_speaks_their_units():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from gradnorm.teach import sweeps, views

    _, plan = sweeps.packed_pairs(4)
    pairs = imbalance.pairs_minibatch(plan)
    artists = views.imbalance_figure(Figure(), pairs, objective="dpo", reference="pair")
    heights = [bar.get_height() for bar in artists["weights"]["local"]]
    assert heights[0] == pytest.approx(26 / 8) and heights[-1] == pytest.approx(26 / 32)  # v x P
    assert "pairs" in artists["note"].get_text() and "v × P" in artists["line"].get_label()
    sft = views.imbalance_figure(Figure(), imbalance.imbalanced_minibatch(), objective="sft")
    assert "label tokens" in sft["note"].get_text()
    grpo = views.imbalance_figure(Figure(), imbalance.imbalanced_minibatch())
    assert "of the tokens," in grpo["note"].get_text()  # 01's words unchanged
