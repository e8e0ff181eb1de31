"""GRPO loss pieces against formulas written out by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from gradnorm.core.grpo import (
    clipped_surrogate,
    entropy_from_logits,
    finalize_stats,
    group_advantages,
    grpo_token_losses,
    kl_estimate,
    stat_sums,
)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])  # groups of 2: (1, 0), (0, 1), (0.5, 0.5)
    # Group (1, 0): mean 0.5, Bessel std sqrt(0.5); a constant group has zero advantage.
    s = math.sqrt(0.5)
    assert_close(group_advantages(rewards, 2, eps=0.0)[:4], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]))
    assert_close(group_advantages(rewards, 2)[4:], torch.zeros(2))
    assert_close(group_advantages(rewards, 2, scale_by_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_group_advantages_reject_bad_groups():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="do not split"):
        group_advantages(torch.zeros(5), 2)


def test_clipped_surrogate_by_hand():
    # ratios 0.5, 1.0, 1.5 with advantage +1 and -1; clip range [0.8, 1.2].
    ratio = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    logp, old = ratio.log(), torch.zeros(2, 3)
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([1.0, -1.0]), clip_low=0.2, clip_high=0.2)
    # A > 0: -min(r, clip(r)) = -0.5, -1, -1.2 ; A < 0: -min(-r, -clip(r)) = 0.8, 1, 1.5
    assert_close(loss, torch.tensor([[-0.5, -1.0, -1.2], [0.8, 1.0, 1.5]]))
    assert clipped.tolist() == [[False, False, True], [True, False, False]]


def test_clip_higher_uses_separate_ranges():
    logp, old = torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1)
    loss_sym, _ = clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    loss_dapo, _ = clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    assert_close(loss_sym, torch.tensor([[-1.2]]))
    assert_close(loss_dapo, torch.tensor([[-1.25]]))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # r = ref/p = 0.5
    assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([math.log(2.0)]))
    assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * math.log(0.5) ** 2]))
    assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 - 1 - math.log(0.5)]))
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    # Expectations taken exactly, over every outcome x weighted by p(x): no sampling noise.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum()
    expectation = {kind: (p * kl_estimate(p.log(), q.log(), kind)).sum() for kind in ["k1", "k2", "k3"]}
    assert_close(expectation["k1"], true_kl)
    assert_close(expectation["k3"], true_kl)
    # Control: k2 is biased, so the same comparison must fail for it.
    assert abs(expectation["k2"] - true_kl) > 1e-3
    assert (kl_estimate(p.log(), q.log(), "k3") >= 0).all()


def test_entropy_from_logits_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30]]))
    assert_close(entropy_from_logits(logits), torch.tensor([1.5 * math.log(2.0), 0.0]))


def test_beta_zero_needs_no_reference_policy():
    logp = torch.zeros(2, 3, requires_grad=True)
    terms = grpo_token_losses(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), beta=0.0, ref_logp=None)
    assert terms.kl is None
    assert_close(terms.loss, terms.pg_loss)
    stats = finalize_stats(stat_sums(torch.full((2, 3), 1 / 6), torch.ones(2, 3, dtype=torch.bool), terms), with_kl=False)
    assert "kl" not in stats and stats["tokens"] == 6
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_token_losses(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), beta=0.1)


def test_loss_adds_beta_times_kl():
    logp, old, ref = torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[0.1, -0.2]])
    terms = grpo_token_losses(logp, old, torch.tensor([2.0]), ref_logp=ref, beta=0.5)
    assert_close(terms.loss, terms.pg_loss + 0.5 * kl_estimate(logp, ref))


def test_stats_are_token_means_and_the_objective():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss = torch.tensor([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0]])
    terms = grpo_token_losses(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, 1.0]),
                              ref_logp=torch.zeros(2, 3), beta=1.0, entropy=loss)
    terms.loss = loss  # the objective reads w * l; 99 sits off the mask and must not count
    w = mask / 3.0
    stats = finalize_stats(stat_sums(w, mask, terms))
    assert_close(stats["loss"], (1 + 2 + 4) / 3)
    assert_close(stats["entropy"], (1 + 2 + 4) / 3)
    assert stats["tokens"] == 3 and stats["clipfrac"] == 0.0
    # No tokens at all: zeros, not NaN.
    empty = finalize_stats(torch.zeros(6, dtype=torch.float64))
    assert all(math.isfinite(v) for v in empty.values())
