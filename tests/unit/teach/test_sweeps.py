"""Gradient sweeps (``gradnorm.teach.sweeps``): every mode's sharded gradient against the full batch.

GRPO's loss, SFT's cross-entropy and DPO's mean over pairs, on ``toy``'s policy. Each sweep comes
with its control: at imbalance 1 (balanced microbatches) ``local`` is exact, and it must not be as
soon as counts are ragged, while the fixed modes stay exact to rounding.
"""

from fractions import Fraction

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from gradnorm.teach import imbalance, sweeps
from gradnorm.teach.imbalance import token_layout
from gradnorm.core.modes import INVARIANT_MODES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def fractions(weights):
    return [Fraction(float(w)).limit_denominator(10_000) for w in weights]


def test_ragged_lengths():
    assert sweeps.ragged_lengths(1, 8) == (12,) * 8
    lengths = np.array(sweeps.ragged_lengths(12, 32))
    assert lengths.min() >= 1 and lengths.max() <= 12 and lengths.max() / lengths.min() >= 6
    # one draw serves every imbalance: a response never gets shorter than another it was longer than
    a, b = np.array(sweeps.ragged_lengths(4, 32)), lengths
    assert np.all(np.subtract.outer(a, a) * np.subtract.outer(b, b) >= 0)
    assert sweeps.ragged_lengths(4, 32, seed=1) != sweeps.ragged_lengths(4, 32, seed=0)


def test_gradient_sweep_local_drifts_and_the_fixed_modes_do_not():
    sweep = sweeps.gradient_sweep([1, 4, 12], shard="length", world_size=2, accum_steps=2)
    assert sweep.microbatch_tokens.shape == (3, 2, 2)
    assert np.all(sweep.microbatch_tokens[0] == 8 * 12)  # imbalance 1: 8 responses of 12 tokens each
    for mode in INVARIANT_MODES:
        assert sweep.relative_error[mode].max() < 1e-12, mode
        assert_allclose(sweep.cosine[mode], 1.0, atol=1e-12)
    local = sweep.relative_error["local"]
    assert local[0] < 1e-12  # balanced microbatches: the mean of means is the mean (control)
    assert local[1] > 0.1 and local[2] > local[1]  # and it grows with the imbalance
    assert sweep.cosine["local"][2] < 0.95


def test_gradient_of_a_constant_is_the_token_gradient_rescaled():
    lengths = sweeps.ragged_lengths(4, 16)
    token = sweeps.policy_gradient(lengths, "token")
    constant = sweeps.policy_gradient(lengths, "constant")  # C = S * 12
    torch.testing.assert_close(constant, token * sum(lengths) / (16 * 12))


def test_compare():
    g = torch.tensor([1.0, 0.0])
    assert sweeps.compare(g, g) == (0.0, 1.0)
    rel, cos = sweeps.compare(torch.tensor([0.0, 1.0]), g)
    assert rel == pytest.approx(2 ** 0.5) and cos == pytest.approx(0.0)
    assert sweeps.compare(torch.zeros(2), torch.zeros(2)) == (0.0, 1.0)


# ------------------------------------------------------------------ SFT and DPO


def test_sft_has_the_same_bug_and_the_same_fix():
    sweep = sweeps.gradient_sweep([1, 4], modes=("local", "token"), shard="length", loss="sft")
    assert sweep.relative_error["token"].max() < 1e-12
    assert sweep.relative_error["local"][0] < 1e-12 and sweep.relative_error["local"][1] > 0.1


def test_packed_pairs_by_hand():
    lengths, plan = sweeps.packed_pairs(4, world_size=2, accum_steps=2, pairs_per_microbatch=8, short_length=6)
    pairs = imbalance.pairs_minibatch(plan)
    assert pairs.microbatch_tokens().tolist() == [[2, 8], [8, 8]]
    assert lengths[:4] == (24, 24, 24, 24) and set(lengths[4:]) == {6} and len(lengths) == 2 * 26
    tokens = [[sum(lengths[2 * p] + lengths[2 * p + 1] for p in mb.tolist()) for mb in rank] for rank in plan]
    assert tokens == [[96, 96], [96, 96]]  # one token budget for every microbatch
    local, _ = imbalance.layout_and_shares(pairs, "local", objective="dpo")
    fix, _ = imbalance.layout_and_shares(pairs, "pair", objective="dpo")
    assert fractions(local.weight[[0, -1]]) == [Fraction(1, 8), Fraction(1, 32)]  # 1/(W A P[r, m])
    assert fractions(fix.weight[[0, -1]]) == [Fraction(1, 26)] * 2  # 1/P


def test_sft_weights_of_a_minibatch_are_grpos_token_weights_and_a_pair_is_one_unit():
    """SFT's table is GRPO's without groups, and a pair weighed as one unit is token's rule: the
    library's SFT and pair weights agree with GRPO's effective weights where the math says so."""
    batch = imbalance.imbalanced_minibatch(2, 2, 4)
    for mode in ("local", "token", "sequence"):
        sft, _ = imbalance.layout_and_shares(batch, mode, objective="sft")
        assert_allclose(sft.weight, token_layout(batch, mode).weight, rtol=1e-15)
    _, plan = sweeps.packed_pairs(4)
    pairs = imbalance.pairs_minibatch(plan)
    for pair_mode, token_mode in (("local", "local"), ("pair", "token")):
        got, _ = imbalance.layout_and_shares(pairs, pair_mode, objective="dpo")
        assert_allclose(got.weight, token_layout(pairs, token_mode).weight, rtol=1e-15)
    with pytest.raises(ValueError, match="unknown objective"):
        imbalance.layout_and_shares(batch, "token", objective="ppo")


def test_dpo_pair_losses_longhand():
    from gradnorm.teach.toy import make_policy, make_problem
    from torch.nn.functional import logsigmoid

    problem = make_problem(lengths=[3, 5, 2, 4], group_size=2, max_len=6)
    policy = make_policy(0)
    with torch.no_grad():
        logp = torch.log_softmax(policy(problem.inputs), -1).gather(-1, problem.targets.unsqueeze(-1)).squeeze(-1)
    margin = [float(((logp[i] - problem.ref_logp[i]) * problem.mask[i]).sum()) for i in range(4)]
    expected = [-float(logsigmoid(torch.tensor(0.1 * (margin[2 * p] - margin[2 * p + 1]), dtype=torch.float64)))
                for p in range(2)]
    got = sweeps.dpo_pair_losses(policy, problem, torch.arange(2), beta=0.1)
    assert got.shape == (2,)
    assert_allclose(got.detach().numpy(), expected, rtol=1e-12)


def test_dpo_sweep_exact_with_equal_pair_counts_and_not_otherwise():
    sweep = sweeps.dpo_sweep([1, 4])
    assert sweep.unit == "pairs" and sweep.microbatch_tokens[1].tolist() == [[2, 8], [8, 8]]
    assert sweep.relative_error["pair"].max() < 1e-12
    assert sweep.relative_error["local"][0] < 1e-12  # the same number of pairs everywhere: exact
    assert sweep.relative_error["local"][1] > 0.1 and sweep.cosine["local"][1] < 0.95


def test_long_pairs_explain_locals_cosine_exactly_and_a_wrong_share_does_not():
    ratios = [1, 8 / 3, 4]
    lp, dpo = sweeps.long_pairs(ratios), sweeps.dpo_sweep(ratios)
    assert_allclose(lp.predicted_cosine(), dpo.cosine["local"], rtol=0, atol=1e-9)
    assert_allclose(lp.share_full, [8 / 32, 3 / 27, 2 / 26]) and set(lp.share_local) == {0.25}
    wrong = sweeps.LongPairs(lp.x, lp.share_full, lp.share_full * 2, lp.norm_ratio, lp.cosine_long_short)
    assert abs(wrong.predicted_cosine() - dpo.cosine["local"])[1:].min() > 1e-3  # the control


def test_sweep_legends_name_a_grpo_paper_only_on_a_grpo_loss():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradnorm.teach.plotting import plot_gradient_sweep
    from gradnorm.teach.sweeps import GradientSweep

    labels = {}
    for loss in ("grpo", "sft"):
        sweep = GradientSweep(shard="length", world_size=2, accum_steps=2, x=np.array([1.0, 2.0]),
                              microbatch_tokens=np.ones((2, 2, 2)), relative_error={"local": np.array([0.0, 0.1]),
                              "token": np.zeros(2), "sequence": np.zeros(2)},
                              cosine={m: np.ones(2) for m in ("local", "token", "sequence")}, loss=loss)
        fig, (a, b) = plt.subplots(1, 2)
        plot_gradient_sweep(a, b, sweep)
        labels[loss] = [t.get_text() for t in a.get_legend().get_texts()]
        plt.close(fig)
    assert labels["grpo"] == ["local", "token (DAPO)", "sequence (DeepSeekMath GRPO)"]  # the control
    assert labels["sft"] == ["local", "token", "sequence"]
